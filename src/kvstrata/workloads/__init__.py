"""Request workloads: where the token sequences that kvstrata replays come from.

Every source is deterministic and yields :class:`Request` objects (uint32 token arrays):

* **Mooncake traces** (:func:`load_mooncake`): JSONL files of the Mooncake FAST'25 release, one
  request per line with ``timestamp`` (ms), ``input_length`` and ``hash_ids``. Each hash id names a
  512-token block; it expands into the tokens of a random stream seeded by the id alone, so equal
  ids give equal tokens in any request, at any position, in any process, and requests sharing
  leading ids share exactly those leading tokens::

      hash_ids      [ 0      | 14     | 15     ]      input_length = 1300
      tokens        [0:512)   [512:1024) [1024:1300)   the last block is cut to input_length

  Token ``j`` of block ``h`` is the high 32 bits of the ``j``-th raw output of
  ``numpy.random.PCG64(h)`` (a stream numpy keeps stable across versions and platforms), reduced
  modulo the vocabulary, so the same id maps to the same raw block whatever the vocabulary.
* **Synthetic** (:func:`synthetic`): the shared multi-turn chat generator in
  :mod:`kvstrata.workloads.shared_synthetic` (system prompts picked with a Zipf skew, sessions that re-send every
  previous turn), mapped into the model's vocabulary.
* **Built-in** (:func:`builtin`): 48 short requests (80 to 600 tokens) from interleaved chat
  sessions over four shared system prompts; the default of ``kvstrata replay``, small enough to
  run through a tiny model on CPU in seconds.

* **Agentic** (:mod:`kvstrata.workloads.agentic`): long agentic coding sessions that grow by tool outputs,
  fork sub-agents and overlap by the hundred, generated lazily.

:func:`load_workload` resolves a command-line spec (``builtin``, ``synthetic[:SEED[:N]]``,
``agentic[:SEED[:N]]`` or a path to a ``.jsonl`` trace) into a :class:`Workload`. A workload is
*streamed*: iterating it reads (or generates) one request at a time, so a replay holds the requests
in flight, never the whole workload; a trace of any length is never loaded whole.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeGuard

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, InvalidTokensError, WorkloadError
from . import agentic as _agentic
from . import shared_synthetic as _synthetic
from .blocks import BlockExpander, raw_to_tokens

TokenArray = npt.NDArray[np.uint32]

DEFAULT_VOCAB_SIZE = 128_256  # Llama 3's vocabulary, also the shared synthetic generator's
MOONCAKE_BLOCK_TOKENS = 512
ON_ERROR = ("stop", "skip")
#: Skipped trace lines a workload keeps with their reasons (every one is counted).
MAX_SKIPPED_KEPT = 100
#: Expanded Mooncake blocks kept for reuse, least recently used out first (8 MiB at 512 tokens).
BLOCK_CACHE_BLOCKS = 4096
#: Trace lines parsed, and their new blocks seeded, at a time (see :mod:`.blocks`).
LOOKAHEAD_LINES = 32
_TRACE_FIELDS = ("timestamp", "input_length", "hash_ids")

# The built-in workload's shape; see builtin().
_BUILTIN_PROMPT_TOKENS = (64, 96, 128, 192)
_BUILTIN_PROMPT_PICKS = (0, 0, 0, 1, 1, 2, 3)  # skewed: most sessions share the first prompt
_BUILTIN_SESSIONS = 6
_BUILTIN_TURNS = (2, 8)
_BUILTIN_TURN_TOKENS = (16, 96)
_BUILTIN_MAX_TOKENS = 600
BUILTIN_REQUESTS = 48


@dataclass(frozen=True, slots=True, eq=False)
class Request:
    """One prefill request.

    ``rid`` numbers the requests of a workload 0, 1, 2, ... in order; ``tokens`` is a non-empty 1-D
    uint32 array; ``arrival_ms`` is the trace timestamp, ``None`` for generated workloads. Equality
    is identity (ndarray ``==`` is elementwise): compare ``tokens`` with ``numpy.array_equal``.
    """

    rid: int
    tokens: TokenArray
    arrival_ms: int | None = None

    def __post_init__(self) -> None:
        t = self.tokens
        if not isinstance(t, np.ndarray) or t.dtype != np.uint32 or t.ndim != 1 or t.size == 0:
            raise InvalidTokensError(
                f"request {self.rid}: tokens must be a non-empty 1-D uint32 array, got "
                f"{getattr(t, 'dtype', type(t).__name__)} of shape {getattr(t, 'shape', '?')}"
            )


@dataclass(frozen=True, slots=True)
class SkippedLine:
    """A trace line that ``on_error="skip"`` left out: its 1-based number and what was wrong."""

    line_no: int
    reason: str


class Workload:
    """A workload, read lazily: iterating it yields its requests in order, each read (or generated)
    only when asked for, so nothing here grows with the workload's length.

    Every iteration starts over (a trace is read again from its first line) and resets
    :attr:`num_skipped` and :attr:`skipped`: the trace lines ``on_error="skip"`` left out so far,
    the first :data:`MAX_SKIPPED_KEPT` of them with their reasons. A malformed line with
    ``on_error="stop"`` raises :class:`WorkloadError` from the iteration when it is reached.
    ``num_requests`` is the number of requests when it is known without reading them (generated
    workloads), else None.
    """

    def __init__(
        self,
        source: str,
        open_requests: Callable[[Callable[[SkippedLine], None]], Iterator[Request]],
        *,
        limit: int | None = None,
        num_requests: int | None = None,
    ) -> None:
        self.source = source
        self.limit = limit
        self.num_requests = num_requests
        self.num_skipped = 0
        self.skipped: list[SkippedLine] = []
        self._open = open_requests

    def __iter__(self) -> Iterator[Request]:
        self.num_skipped = 0
        self.skipped = []
        return itertools.islice(self._open(self._skip), self.limit)

    def _skip(self, line: SkippedLine) -> None:
        self.num_skipped += 1
        if len(self.skipped) < MAX_SKIPPED_KEPT:
            self.skipped.append(line)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive(name: str, value: object) -> None:
    if not _is_int(value) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def _check_vocab_size(vocab_size: object) -> None:
    if not _is_int(vocab_size) or not 1 <= vocab_size <= 2**32:
        raise ConfigError(f"vocab_size must be an integer in [1, 2**32], got {vocab_size!r}")


def _check_load_args(limit: int | None, vocab_size: int, on_error: str) -> None:
    if limit is not None:
        _check_positive("limit", limit)
    _check_vocab_size(vocab_size)
    if on_error not in ON_ERROR:
        raise ConfigError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")


class _BadLine(Exception):
    """A trace line is malformed; the message says what is wrong (without file and line)."""


def _parse_line(
    line: bytes, block_tokens: int, max_tokens: int | None = None
) -> tuple[int, int, list[int]]:
    """Validate one trace line and return its ``(timestamp, input_length, hash_ids)``.

    A request longer than ``max_tokens`` is refused here, before its tokens are expanded.
    """
    try:
        record = json.loads(line)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
        raise _BadLine(f"invalid JSON: {e}") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise _BadLine("invalid JSON: nested too deeply") from None
    if not isinstance(record, dict):
        raise _BadLine(f"expected a JSON object, got {type(record).__name__}")
    missing = [name for name in _TRACE_FIELDS if name not in record]
    if missing:
        raise _BadLine(f"missing field {', '.join(missing)}")
    timestamp, input_length, hash_ids = (record[name] for name in _TRACE_FIELDS)
    if not _is_int(timestamp) or timestamp < 0:
        raise _BadLine(f"timestamp must be an integer >= 0 (ms), got {timestamp!r}")
    if not _is_int(input_length) or input_length < 1:
        raise _BadLine(f"input_length must be an integer >= 1, got {input_length!r}")
    if max_tokens is not None and input_length > max_tokens:
        raise _BadLine(
            f"input_length {input_length:,} exceeds the {max_tokens:,} tokens a request may have "
            "here (the smaller of the device pool and the model's positions); raise --l1-tokens, "
            "or leave such lines out with --on-error skip"
        )
    if not isinstance(hash_ids, list) or not hash_ids:
        raise _BadLine(f"hash_ids must be a non-empty list, got {hash_ids!r}")
    for i, h in enumerate(hash_ids):
        if not _is_int(h) or h < 0:
            raise _BadLine(f"hash_ids[{i}] must be an integer >= 0, got {h!r}")
    if input_length > len(hash_ids) * block_tokens:
        raise _BadLine(
            f"input_length {input_length} exceeds the {len(hash_ids) * block_tokens} tokens its "
            f"{len(hash_ids)} hash ids of {block_tokens} tokens cover"
        )
    return timestamp, input_length, hash_ids


def load_mooncake(
    path: str | Path,
    *,
    limit: int | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    on_error: str = "stop",
    max_tokens: int | None = None,
    block_cache_blocks: int = BLOCK_CACHE_BLOCKS,
) -> Workload:
    """A Mooncake JSONL trace as a streamed workload (see the module docstring for how hash ids
    become tokens).

    The file is read one line at a time while the workload is iterated, up to ``limit`` requests
    (all when ``None``); only ``block_cache_blocks`` expanded blocks are kept. Blank lines are
    ignored. A malformed line raises :class:`WorkloadError` naming ``path:line`` and what is wrong
    when the iteration reaches it (``on_error="stop"``); with ``on_error="skip"`` it is left out
    and counted in :attr:`Workload.num_skipped`. Request ids stay dense (0, 1, 2, ...) either way.
    A line longer than ``max_tokens`` is malformed too, refused before its tokens take any memory.
    A file that cannot be opened raises here, before any iteration.
    """
    _check_load_args(limit, vocab_size, on_error)
    _check_positive("block_tokens", block_tokens)
    _check_positive("block_cache_blocks", block_cache_blocks)
    if max_tokens is not None:
        _check_positive("max_tokens", max_tokens)
    path = Path(path)
    _open_trace(path).close()

    def read(skip: Callable[[SkippedLine], None]) -> Iterator[Request]:
        expander = BlockExpander(vocab_size, block_tokens, block_cache_blocks)
        with _open_trace(path) as file:
            rid = 0
            numbered = ((n, line) for n, line in enumerate(file, start=1) if line.strip())
            # Lines are parsed and their new blocks seeded LOOKAHEAD_LINES at a time, then handed
            # out one by one in order: a bad line still stops (or is skipped) where it stands.
            while batch := list(itertools.islice(numbered, LOOKAHEAD_LINES)):
                parsed: list[tuple[int, int, list[int]] | _BadLine] = []
                for _, line in batch:
                    try:
                        parsed.append(_parse_line(line, block_tokens, max_tokens))
                    except _BadLine as e:
                        parsed.append(e)
                good = [(p[2], p[1]) for p in parsed if not isinstance(p, _BadLine)]
                tokens = iter(expander.expand_many(good))
                for (line_no, _), p in zip(batch, parsed, strict=True):
                    if isinstance(p, _BadLine):
                        if on_error == "stop":
                            raise WorkloadError(f"{path}:{line_no}: {p}") from None
                        skip(SkippedLine(line_no, str(p)))
                        continue
                    yield Request(rid, next(tokens), p[0])
                    rid += 1

    return Workload(str(path), read, limit=limit)


def _open_trace(path: Path) -> BinaryIO:
    try:
        return path.open("rb")
    except OSError as e:
        raise WorkloadError(f"cannot open trace {path}: {e.strerror}") from e


def synthetic(
    seed: int = 0, n_requests: int = 2000, vocab_size: int | None = None, **params: float
) -> list[Request]:
    """The shared synthetic workload (:func:`kvstrata.workloads.shared_synthetic.generate`) as requests.

    ``params`` override the generator's ``DEFAULTS``. With ``vocab_size`` the token ids are reduced
    modulo it, which keeps equal prefixes equal; without it they stay in ``[0, params["vocab"])``.
    """
    _check_positive("n_requests", n_requests)
    if vocab_size is not None:
        _check_vocab_size(vocab_size)
    unknown = sorted(set(params) - set(_synthetic.DEFAULTS))
    if unknown:
        raise ConfigError(
            f"unknown synthetic workload parameters {unknown}; "
            f"accepted: {', '.join(sorted(_synthetic.DEFAULTS))}"
        )
    _check_vocab_size(params.get("vocab", _synthetic.DEFAULTS["vocab"]))
    return list(_synthetic_requests(seed, n_requests, vocab_size, params))


def _synthetic_requests(
    seed: int, n_requests: int, vocab_size: int | None, params: dict[str, float]
) -> Iterator[Request]:
    # The shared generator returns its lists all at once (14 M tokens at its default 2,000
    # requests); the arrays are made one at a time.
    for rid, token_list in enumerate(_synthetic.generate(seed, n_requests, **params)):
        tokens = np.array(token_list, dtype=np.uint32)
        if vocab_size is not None:
            tokens %= np.uint32(vocab_size)
        yield Request(rid, tokens)


def agentic(
    seed: int = 0,
    n_requests: int = _agentic.DEFAULT_REQUESTS,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    shape: _agentic.AgenticShape | None = None,
) -> Iterator[Request]:
    """The agentic coding workload (:mod:`kvstrata.workloads.agentic`) as requests, generated lazily."""
    _check_positive("n_requests", n_requests)
    _check_vocab_size(vocab_size)
    for rid, r in enumerate(_agentic.generate(seed, n_requests, vocab_size, shape)):
        yield Request(rid, r.tokens, r.arrival_ms)


def builtin(vocab_size: int, *, seed: int = 0, n_requests: int = BUILTIN_REQUESTS) -> list[Request]:
    """A small chat workload with heavy prefix sharing, the default of ``kvstrata replay``.

    Six sessions are open at once; each starts from one of four system prompts (64 to 192 tokens,
    most sessions on the first) and runs 2 to 8 turns of 16 to 96 new tokens, each turn re-sending
    the whole session so far, capped at 600 tokens. Every request comes from a session picked at
    random, so sessions interleave; a finished session is replaced by a new one. All draws are raw
    ``PCG64(seed)`` outputs, so the structure does not depend on ``vocab_size``.
    """
    _check_vocab_size(vocab_size)
    _check_positive("n_requests", n_requests)
    bits = np.random.PCG64(seed)

    def uniform(lo: int, hi: int) -> int:
        return lo + int(bits.random_raw()) % (hi - lo + 1)

    def fresh(num_tokens: int) -> TokenArray:
        return raw_to_tokens(bits.random_raw(num_tokens), vocab_size)

    prompts = [fresh(n) for n in _BUILTIN_PROMPT_TOKENS]

    def new_session() -> tuple[TokenArray, int]:
        pick = _BUILTIN_PROMPT_PICKS[uniform(0, len(_BUILTIN_PROMPT_PICKS) - 1)]
        return prompts[pick], uniform(*_BUILTIN_TURNS)

    # Each session is (tokens sent so far, turns left).
    sessions = [new_session() for _ in range(_BUILTIN_SESSIONS)]
    requests: list[Request] = []
    while len(requests) < n_requests:
        i = uniform(0, len(sessions) - 1)
        turn = fresh(uniform(*_BUILTIN_TURN_TOKENS))
        sent, turns_left = sessions[i]
        if turns_left == 0 or len(sent) + len(turn) > _BUILTIN_MAX_TOKENS:
            sent, turns_left = new_session()
        tokens = np.concatenate([sent, turn])
        sessions[i] = tokens, turns_left - 1
        requests.append(Request(len(requests), tokens))
    return requests


def _parse_synthetic_spec(spec: str) -> tuple[int, int]:
    """``synthetic[:SEED[:N]]`` -> ``(seed, n_requests)``; the defaults are seed 0, 2000 requests."""
    fields = spec.split(":")[1:]
    if len(fields) > 2 or not all(f.isascii() and f.isdigit() for f in fields):
        raise WorkloadError(
            f"bad synthetic workload {spec!r}: expected synthetic, synthetic:SEED or synthetic:SEED:N"
        )
    seed = int(fields[0]) if fields else 0
    n_requests = int(fields[1]) if len(fields) == 2 else 2000
    return seed, n_requests


def load_workload(
    spec: str,
    *,
    limit: int | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    on_error: str = "stop",
    max_tokens: int | None = None,
) -> Workload:
    """Resolve a workload spec: ``builtin``, ``synthetic[:SEED[:N]]``, ``agentic[:SEED[:N]]`` or a
    path to a ``.jsonl`` trace, as a streamed :class:`Workload`.

    ``limit`` caps the number of requests (the first ``limit`` of the workload); ``on_error`` and
    ``max_tokens`` apply to traces (see :func:`load_mooncake`). An unknown spec raises
    :class:`WorkloadError`.
    """
    _check_load_args(limit, vocab_size, on_error)
    if spec == "builtin":
        n = BUILTIN_REQUESTS if limit is None else min(BUILTIN_REQUESTS, limit)
        return Workload(spec, lambda _: iter(builtin(vocab_size, n_requests=n)), num_requests=n)
    if spec == "synthetic" or spec.startswith("synthetic:"):
        seed, n = _parse_synthetic_spec(spec)
        n = n if limit is None else min(n, limit)
        return Workload(
            spec, lambda _: _synthetic_requests(seed, n, vocab_size, {}), num_requests=n
        )
    if spec == "agentic" or spec.startswith("agentic:"):
        seed, n = _agentic.parse_spec(spec)
        n = n if limit is None else min(n, limit)
        return Workload(spec, lambda _: agentic(seed, n, vocab_size), num_requests=n)
    if spec.endswith(".jsonl"):
        return load_mooncake(
            spec, limit=limit, vocab_size=vocab_size, on_error=on_error, max_tokens=max_tokens
        )
    raise WorkloadError(
        f"unknown workload {spec!r}: expected builtin, synthetic[:SEED[:N]], agentic[:SEED[:N]], "
        "or a path to a Mooncake .jsonl trace"
    )
