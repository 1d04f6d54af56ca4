"""The prefill -> decode KV handoff: each rank's owned pages out, the full-layout KV back in.

A finished prefill hands its KV to a decode instance that does not use context parallelism. Each
rank exports the pages it owns (sequence page ``i`` lives on rank ``i % cp_size``) with their page
indices, for every payload and layer, stamped with the layout's fingerprint (model, dtype, page
size, payload shapes, format version: :func:`layout_fingerprint`)::

    rank 0: pages 0, 2, 4     \\
    rank 1: pages 1, 3         >-- transport --> assemble() -> per payload [layers, tokens, *shape]
                              /

:func:`assemble` refuses parts whose fingerprint differs from the receiver's, parts of another
request or cp size, and a set of parts that does not cover every page exactly once, naming the
rank. Transports implement :class:`HandoffTransport`: :class:`LoopbackTransport` hands parts over
in memory (one process), :class:`DirectoryTransport` through files on a shared filesystem (one
process per rank); a network transport (NIXL, Mooncake's transfer engine) is another adapter of
the same two calls. Parts on disk are safetensors files, never pickles.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from .config import KVLayout
from .errors import ConfigError, HandoffError
from .ownership import page_span
from .tiers.page_hash import Namespace
from .tiers.pool import DevicePool


def layout_fingerprint(model_id: str, layout: KVLayout, page_size: int) -> str:
    """What a receiver must match to read the bytes: model, payload names/shapes/dtypes, layers,
    page size and format version (cp size excluded: the assembled KV does not depend on it)."""
    return Namespace.for_layout(model_id, layout, page_size, 1).digest.hex()


@dataclass(frozen=True)
class Handoff:
    """One rank's part of one request's KV.

    pages: the sequence page indices this rank owns (ascending); token ``t`` of page ``i`` is
        position ``i * page_size + t``.
    payloads: per payload name, ``[num_layers, len(pages), page_size, *token_shape]`` on the CPU.
    num_tokens: the request's prompt length (the last page may be partial).
    """

    rid: int
    rank: int
    cp_size: int
    num_tokens: int
    page_size: int
    fingerprint: str
    pages: npt.NDArray[np.int64]
    payloads: Mapping[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.payloads.values())


def export_handoff(
    pool: DevicePool,
    rid: int,
    page_ids: npt.NDArray[np.int64],
    num_tokens: int,
    rank: int,
    cp_size: int,
    fingerprint: str,
) -> Handoff:
    """This rank's part of a request's KV: its owned pages (``page_ids`` are the request's logical
    page ids, page ``i`` owned by rank ``i % cp_size`` at slot ``page_ids[i] // cp_size``)."""
    P = pool.page_size
    n = page_span(num_tokens, P)
    if page_ids.size < n:
        raise HandoffError(
            f"request {rid}: {num_tokens} tokens need {n} pages, got {page_ids.size}"
        )
    mine = np.arange(rank, n, cp_size, dtype=np.int64)
    slots = torch.from_numpy(page_ids[mine] // cp_size).to(pool.device)
    payloads = {
        spec.name: torch.stack(
            [
                pool.buffer(spec.name, layer).index_select(0, slots)
                for layer in range(pool.layout.layers(spec))
            ]
        ).cpu()
        for spec in pool.layout.payloads
    }
    return Handoff(rid, rank, cp_size, num_tokens, P, fingerprint, mine, payloads)


@dataclass(frozen=True)
class AssembledKV:
    """A request's whole KV in the receiver's layout: per payload ``[layers, tokens, *shape]``."""

    rid: int
    num_tokens: int
    page_size: int
    fingerprint: str
    payloads: Mapping[str, torch.Tensor]


def assemble(parts: list[Handoff], fingerprint: str) -> AssembledKV:
    """The full KV of one request from every rank's part; ``fingerprint`` is the receiver's
    :func:`layout_fingerprint`. Raises :class:`HandoffError` naming the part that disagrees."""
    if not parts:
        raise HandoffError("no handoff parts to assemble")
    first = parts[0]
    for part in parts:
        if part.fingerprint != fingerprint:
            raise HandoffError(
                f"request {part.rid}: the part from rank {part.rank} has layout fingerprint "
                f"{part.fingerprint[:16]}, this decoder expects {fingerprint[:16]} (another model, "
                "dtype, page size or payload set): refusing to read its bytes"
            )
        for name in ("rid", "cp_size", "num_tokens", "page_size"):
            if getattr(part, name) != getattr(first, name):
                raise HandoffError(
                    f"request {first.rid}: the part from rank {part.rank} has {name} "
                    f"{getattr(part, name)}, the part from rank {first.rank} has "
                    f"{getattr(first, name)}"
                )
        if set(part.payloads) != set(first.payloads):
            raise HandoffError(
                f"request {first.rid}: rank {part.rank} sent payloads {sorted(part.payloads)}, "
                f"rank {first.rank} sent {sorted(first.payloads)}"
            )
    ranks = sorted(p.rank for p in parts)
    if ranks != list(range(first.cp_size)):
        raise HandoffError(
            f"request {first.rid}: parts from ranks {ranks}, a cp_size {first.cp_size} handoff "
            f"needs one from each of {list(range(first.cp_size))}"
        )
    P, n = first.page_size, first.num_tokens
    num_pages = page_span(n, P)
    owner = np.full(num_pages, -1, dtype=np.int64)
    for part in parts:
        if part.pages.size and (part.pages.min() < 0 or part.pages.max() >= num_pages):
            raise HandoffError(
                f"request {first.rid}: rank {part.rank} sent page indices outside [0, {num_pages})"
            )
        doubled = part.pages[owner[part.pages] >= 0]
        if doubled.size:
            raise HandoffError(
                f"request {first.rid}: page {int(doubled[0])} came from rank {part.rank} and from "
                f"rank {int(owner[doubled[0]])}"
            )
        owner[part.pages] = part.rank
    if (owner < 0).any():
        raise HandoffError(
            f"request {first.rid}: no rank sent page {int(np.flatnonzero(owner < 0)[0])}"
        )
    payloads = {}
    for name, ref in first.payloads.items():
        layers, shape = ref.shape[0], ref.shape[3:]
        out = torch.empty((layers, num_pages, P, *shape), dtype=ref.dtype)
        for part in parts:
            out[:, torch.from_numpy(part.pages)] = part.payloads[name]
        payloads[name] = out.view(layers, num_pages * P, *shape)[:, :n]
    return AssembledKV(first.rid, n, P, fingerprint, payloads)


class HandoffTransport(Protocol):
    """Carries handoff parts from prefill ranks to a decoder."""

    def send(self, part: Handoff) -> None: ...

    def receive(self, rid: int, timeout_s: float = 60.0) -> list[Handoff]:
        """Every part of request ``rid`` (waiting up to ``timeout_s`` for the last one)."""
        ...


class LoopbackTransport:
    """In memory, within one process: parts wait in a dict until received."""

    def __init__(self) -> None:
        self._parts: dict[int, list[Handoff]] = {}

    def send(self, part: Handoff) -> None:
        self._parts.setdefault(part.rid, []).append(part)

    def receive(self, rid: int, timeout_s: float = 60.0) -> list[Handoff]:
        parts = self._parts.pop(rid, [])
        if not parts:
            raise HandoffError(f"request {rid}: no handoff was sent")
        missing = parts[0].cp_size - len(parts)
        if missing:
            raise HandoffError(f"request {rid}: {missing} of {parts[0].cp_size} parts never sent")
        return parts


#: The names a :class:`DirectoryTransport` writes: parts and their temporary files.
PART_NAME = re.compile(r"^\d+\.rank\d+\.(safetensors|tmp)$")
#: The safetensors metadata key every part carries.
META_KEY = "kvstrata_handoff"


class DirectoryTransport:
    """Through a directory that every rank and the decoder can reach: one safetensors file per
    part (``rid.rankR.safetensors``, written under a temporary name and renamed, so a reader never
    sees half a file), metadata in the file's header.

    A run hands over through a subdirectory of its own (:meth:`create`, on one rank), so it never
    meets, reads or deletes another run's files or the user's: :meth:`close` removes only parts of
    :data:`PART_NAME` that carry :data:`META_KEY` (and its own temporary files), then the
    subdirectory if that left it empty."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise HandoffError(
                f"the handoff directory {self.directory} does not exist or is not a directory"
            )

    @classmethod
    def create(cls, parent: str | os.PathLike[str]) -> DirectoryTransport:
        """A new subdirectory of ``parent`` (created if missing) for one run's parts."""
        try:
            os.makedirs(parent, exist_ok=True)
            return cls(tempfile.mkdtemp(prefix="kvstrata-handoff-", dir=parent))
        except OSError as err:
            raise ConfigError(
                f"--handoff-dir {parent}: cannot create a directory there ({err.strerror}); "
                "give a writable directory every rank can reach"
            ) from None

    def close(self) -> None:
        """Remove what this transport's run left (parts never received, half-written files) and
        the directory itself once empty; anything else stays."""
        for path in self.directory.iterdir():
            if PART_NAME.match(path.name) is None or not path.is_file() or path.is_symlink():
                continue
            if path.suffix == ".tmp" or _is_part(path):
                path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # something that is not ours is in it: leave it
            self.directory.rmdir()

    def _path(self, rid: int, rank: int) -> Path:
        return self.directory / f"{rid}.rank{rank}.safetensors"

    def send(self, part: Handoff) -> None:
        _need_safetensors()
        from safetensors.torch import save_file

        meta = {
            "rid": part.rid,
            "rank": part.rank,
            "cp_size": part.cp_size,
            "num_tokens": part.num_tokens,
            "page_size": part.page_size,
            "fingerprint": part.fingerprint,
        }
        tensors = {f"payload.{k}": v.contiguous() for k, v in part.payloads.items()}
        tensors["pages"] = torch.from_numpy(part.pages)
        path = self._path(part.rid, part.rank)
        tmp = path.with_suffix(".tmp")
        try:
            save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(meta)})
            os.replace(tmp, path)
        except (OSError, RuntimeError) as err:  # safetensors reports a full disk as either
            tmp.unlink(missing_ok=True)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise HandoffError(
                f"request {part.rid}: cannot write the handoff part {path} ({first}); free space "
                "or give --handoff-dir on another filesystem"
            ) from None

    def receive(self, rid: int, timeout_s: float = 60.0) -> list[Handoff]:
        _need_safetensors()
        deadline = time.monotonic() + timeout_s
        first = self._wait(self._path(rid, 0), deadline)
        parts = [_read_part(first)]
        for rank in range(1, parts[0].cp_size):
            parts.append(_read_part(self._wait(self._path(rid, rank), deadline)))
        for rank in range(len(parts)):
            self._path(rid, rank).unlink(missing_ok=True)
        return parts

    @staticmethod
    def _wait(path: Path, deadline: float) -> Path:
        while not path.exists():
            if time.monotonic() > deadline:
                raise HandoffError(f"no handoff part at {path} before the timeout")
            time.sleep(0.01)
        return path


def _is_part(path: Path) -> bool:
    """Whether ``path`` is a safetensors file with a kvstrata handoff's metadata."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return META_KEY in (f.metadata() or {})
    except (OSError, SafetensorError):
        return False


def _read_part(path: Path) -> Handoff:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(META_KEY)
        if raw is None:
            raise HandoffError(f"{path} is not a kvstrata handoff part (no metadata)")
        meta = json.loads(raw)
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
    payloads = {k.removeprefix("payload."): v for k, v in tensors.items() if k != "pages"}
    return Handoff(
        rid=int(meta["rid"]),
        rank=int(meta["rank"]),
        cp_size=int(meta["cp_size"]),
        num_tokens=int(meta["num_tokens"]),
        page_size=int(meta["page_size"]),
        fingerprint=str(meta["fingerprint"]),
        pages=tensors["pages"].numpy().astype(np.int64),
        payloads=payloads,
    )


def _need_safetensors() -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError as e:  # the hf extra
        raise ConfigError(
            "the directory handoff transport writes safetensors files: pip install 'kvstrata[hf]'"
        ) from e
