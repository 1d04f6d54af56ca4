"""``--verify``: a sample of the replay's requests recomputed with an empty cache and compared
with what the cache served (logits, or payload bytes with model ``none``), and with
``--decode-tokens`` greedy decoding from each one's handoff against decoding without the cache."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import torch

from ..decode import Decoded, greedy_decode
from ..dist.group import Group
from ..engine import Engine, EngineConfig, Finished
from ..errors import ConfigError
from ..handoff import (
    DirectoryTransport,
    Handoff,
    HandoffTransport,
    LoopbackTransport,
    assemble,
    layout_fingerprint,
)
from ..model.compute import Compute, ModelCompute, PairCompute, SyntheticCompute, synthetic_payload
from ..model.decoder import Decoder
from ..ownership import page_span
from ..progress import Progress
from ..workloads import Request
from .config import ReplayConfig, model_id
from .reports import DecodeReport, VerifyReport

#: The largest |logit difference| between a cached and an uncached prefill that ``--verify``
#: accepts, by the model's dtype (``--verify-atol`` overrides). Honest runs measured so far:
#:
#: float32   CPU: at most 1.03e-6 (tiny, tiny-qwen2, tiny-qwen3, small; chunked, batched, L2);
#:           H200: 7.2e-7 (check-model tiny-qwen2). Another model's KV: 0.67-0.76 (issue 19).
#: bfloat16  CPU: at most 0.0156 (small, 40 requests, chunk 64, one near-tie argmax flip with a
#:           margin of 0.008); H200: 0.0049 (tiny), 0.090-0.125 (the llama-3.2-1b preset, the
#:           first 200 conversation requests), 0.113 (the same preset, 150 of the first 300
#:           requests; argmax agreement 0.967, all flips near-ties). 0.5 is 4.4x the largest,
#:           and check-model's tolerance outside float32.
#: float16   CPU: at most 0.00146 (small, as above); H200: 0.0142 (llama-3.2-1b, 150 requests);
#:           its 3 more mantissa bits make it 8x finer than bfloat16: 0.5 / 8.
#:
#: docs/benchmarks.md, "--verify tolerances", has the commands and the table.
VERIFY_ATOL = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.0625}


class VerifySample:
    """Which requests ``--verify`` recomputes: a uniform random sample of ``size`` of them, drawn
    while they stream by, without knowing how many there will be.

    Reservoir sampling (Vitter's Algorithm R) over a ``numpy`` generator seeded with ``seed``: the
    first ``size`` requests fill the sample; request ``i`` (0-based) after them replaces a uniform
    slot with probability ``size / (i + 1)``. The sample depends only on the seed and the request
    order, so it is the same on every run, and it holds at most ``size`` requests and their
    results. A chosen request's id goes into the engine's ``keep_logits`` and comes out again when
    it is replaced.
    """

    def __init__(
        self, size: int, seed: int, keep_logits: set[int], keep_handoff: set[int] | None = None
    ) -> None:
        self.size = size
        self._handoff = keep_handoff if keep_handoff is not None else set()
        self.decode = keep_handoff is not None
        self._rng = np.random.default_rng(seed)
        self._seen = 0
        self._keep = keep_logits
        self.requests: dict[int, Request] = {}  # rid -> request, at most `size` of them
        self._slots: list[int] = []  # rids, one per reservoir slot
        self.finished: dict[int, Finished] = {}  # results of sampled requests, once they finish

    def offer(self, request: Request) -> None:
        """Consider the next request of the stream (before it is added to the engine)."""
        i, self._seen = self._seen, self._seen + 1
        if self.size == 0:
            return
        if len(self._slots) < self.size:
            slot = len(self._slots)
            self._slots.append(request.rid)
        else:
            slot = int(self._rng.integers(0, i + 1))
            if slot >= self.size:
                return
            old = self._slots[slot]
            self._keep.discard(old)
            self._handoff.discard(old)
            del self.requests[old]
            self.finished.pop(old, None)
            self._slots[slot] = request.rid
        self.requests[request.rid] = request
        self._keep.add(request.rid)
        if self._handoff is not self._keep and self.decode:
            self._handoff.add(request.rid)

    def collect(self, finished: Finished) -> None:
        """Keep ``finished`` if its request is in the sample."""
        if finished.rid in self.requests:
            self.finished[finished.rid] = finished


def recompute_uncached(compute: Compute, config: EngineConfig, request: Request) -> torch.Tensor:
    """Last-token logits of ``request`` computed by a fresh engine with an empty cache (same
    page size and chunking), sized for that one request."""
    finished = prefill_uncached(compute, config, request)
    assert finished.logits is not None
    return finished.logits


def prefill_uncached(
    compute: Compute,
    config: EngineConfig,
    request: Request,
    handoff: bool = False,
    model_id: str = "model",
) -> Finished:
    """``request`` prefilled by a fresh engine with an empty cache (same page size and
    chunking), sized for that one request; its logits (and draft logits) kept, and with
    ``handoff`` its KV exported."""
    P = config.page_size
    pool_tokens = page_span(request.tokens.size, P) * P
    fields = {
        **asdict(config),
        "pool_tokens": pool_tokens,
        "l2_tokens": 0,
        "l2_gib": 0.0,
        "l3_dir": None,
        "remote_url": None,  # the reference computes everything itself
    }
    solo = Engine(compute, EngineConfig(**fields), model_id=model_id)
    solo.keep_logits = {request.rid}
    if handoff:
        solo.keep_handoff = {request.rid}
    solo.add(request)
    out: list[Finished] = []
    while solo.has_work():
        out.extend(solo.step())
    (finished,) = out
    if finished.error is not None or finished.logits is None:
        raise ConfigError(f"request {request.rid} cannot be recomputed: {finished.error}")
    return finished


def send_handoffs(transport: HandoffTransport | None, sample: VerifySample) -> None:
    """With ``--decode-tokens`` (a ``transport``): hand this rank's part of each sampled
    request's KV to rank 0's decoder."""
    if transport is None:
        return
    for f in sample.finished.values():
        if f.handoff is not None:
            transport.send(f.handoff)


def verify_sample(
    cfg: ReplayConfig,
    compute: Compute,
    sample: VerifySample,
    progress: bool,
    transport: HandoffTransport | None,
) -> VerifyReport:
    """Recompute each sampled request that was served with an empty cache and compare with the
    cached run; with ``--decode-tokens``, decode from both runs' handoffs (each one's parts
    received through ``transport``) and compare those too. On rank 0: needs no peers."""
    sampled = [f for f in sample.finished.values() if f.error is None]
    requests = sample.requests
    report = VerifyReport(requests=len(sampled))
    if not sampled:
        return report
    if isinstance(compute, SyntheticCompute):
        mismatched = 0
        for f in sampled:
            tokens = torch.from_numpy(requests[f.rid].tokens.astype(np.int64))
            expected = synthetic_payload(tokens, compute.kv_width)
            assert f.payload is not None
            mismatched += int((f.payload != expected).sum())
        report.payload_mismatched_bytes = mismatched
        return report
    draft = isinstance(compute, PairCompute)
    report.atol = atol = verify_atol(cfg, compute)
    diffs = {"target": 0.0, "draft": 0.0}
    agree = {"target": 0, "draft": 0}
    nonfinite = flips = 0
    decoder = _Decoder(cfg, compute) if cfg.decode_tokens else None
    with Progress("verify", len(sampled), enabled=progress) as bar:
        for f in sampled:
            fresh = prefill_uncached(
                compute, cfg.engine, requests[f.rid], decoder is not None, model_id(cfg)
            )
            pairs = [("target", fresh.logits, f.logits)]
            if draft:
                pairs.append(("draft", fresh.draft_logits, f.draft_logits))
            for name, a, b in pairs:
                assert a is not None and b is not None
                diff, bad = compare_logits(a, b)
                diffs[name] = max(diffs[name], diff)
                nonfinite += bad
                if not bad:
                    same, flip = compare_argmax(a, b, atol)
                    agree[name] += same
                    flips += flip
            if decoder is not None:
                assert transport is not None
                decoder.compare(f, fresh, transport.receive(f.rid, cfg.cp_timeout_s))
            bar.update(1)
    report.max_abs_logit_diff = diffs["target"]
    report.argmax_agree = agree["target"] / len(sampled)
    if draft:
        report.draft_max_abs_logit_diff = diffs["draft"]
        report.draft_argmax_agree = agree["draft"] / len(sampled)
    report.nonfinite_logits = nonfinite
    report.argmax_flips = flips
    if decoder is not None:
        report.decode = decoder.report()
    return report


class _Decoder:
    """``--decode-tokens``: greedy decoding from a request's handoff (its parts from every rank,
    assembled) against decoding from a prefill of it with an empty cache."""

    def __init__(self, cfg: ReplayConfig, compute: Compute) -> None:
        self.draft: Decoder | None = None
        if isinstance(compute, PairCompute):
            self.target, self.draft = compute.target, compute.draft
        else:
            assert isinstance(compute, ModelCompute)
            self.target = compute.model
        self.num_tokens = cfg.decode_tokens
        self.fingerprint = layout_fingerprint(model_id(cfg), compute.layout, cfg.engine.page_size)
        self.requests = self.equal = self.hit_requests = self.handoff_bytes = 0
        self.agreed: dict[str, list[bool]] = {"cached": [], "uncached": []}

    def _decode(self, parts: list[Handoff], f: Finished) -> Decoded:
        assert f.logits is not None
        kv = assemble(parts, self.fingerprint)
        return greedy_decode(kv, self.target, f.logits, self.num_tokens, self.draft, f.draft_logits)

    def compare(self, cached: Finished, fresh: Finished, parts: list[Handoff]) -> None:
        assert fresh.handoff is not None
        self.handoff_bytes += sum(p.nbytes for p in parts)
        a, b = self._decode(parts, cached), self._decode([fresh.handoff], fresh)
        self.requests += 1
        # The same tokens, and the same draft verdict at every position (a wrong draft KV would
        # change the draft's proposals, not the target's tokens).
        self.equal += int(a.tokens == b.tokens and a.draft_agreed == b.draft_agreed)
        if cached.cached_len:
            self.hit_requests += 1
            self.agreed["cached"].extend(a.draft_agreed)
            self.agreed["uncached"].extend(b.draft_agreed)

    def report(self) -> DecodeReport:
        def rate(name: str) -> float | None:
            values = self.agreed[name]
            return round(sum(values) / len(values), 6) if values else None

        return DecodeReport(
            requests=self.requests,
            tokens=self.num_tokens,
            tokens_equal=self.equal,
            hit_requests=self.hit_requests,
            acceptance_cached=rate("cached"),
            acceptance_uncached=rate("uncached"),
            handoff_bytes=self.handoff_bytes,
        )


def handoff_transport(cfg: ReplayConfig, group: Group) -> HandoffTransport:
    """How a replay's ranks hand parts to the decoder on rank 0: in memory with one rank, through
    a subdirectory of ``cfg.handoff_dir`` with several (rank 0 creates it for this run and tells
    the others its name; a collective, at the start of the run on every rank)."""
    if group.size == 1:
        return LoopbackTransport()
    if cfg.handoff_dir is None:
        raise ConfigError(
            "--decode-tokens under context parallelism needs --handoff-dir DIR, a directory "
            "every rank can write and rank 0 can read"
        )
    made = DirectoryTransport.create(cfg.handoff_dir) if group.rank == 0 else None
    name = group.broadcast_object(None if made is None else str(made.directory), "handoff")
    return made if made is not None else DirectoryTransport(name)


def compare_logits(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """``(largest |a - b| over positions finite on both sides, NaN/inf values in a and b)``.

    A NaN difference is never 0: ``max()`` over floats silently drops NaN, so non-finite values
    are counted apart and each is a failure for the caller.
    """
    finite_a, finite_b = torch.isfinite(a), torch.isfinite(b)
    nonfinite = int((~finite_a).sum()) + int((~finite_b).sum())
    both = finite_a & finite_b
    diff = (a.double() - b.double()).abs()[both]  # float64: finite logits, finite difference
    return (float(diff.max()) if diff.numel() else 0.0), nonfinite


def verify_atol(cfg: ReplayConfig, compute: Compute) -> float:
    """The tolerance ``--verify`` judges logit differences by: ``cfg.verify_atol``, or the
    measured one for the compute's dtype."""
    if cfg.verify_atol is not None:
        return cfg.verify_atol
    dtype = str(next(iter(compute.layout.payloads)).dtype)
    if dtype not in VERIFY_ATOL:
        raise ConfigError(
            f"no measured --verify tolerance for {dtype} logits ({', '.join(VERIFY_ATOL)} have "
            "one): give --verify-atol"
        )
    return VERIFY_ATOL[dtype]


def compare_argmax(fresh: torch.Tensor, cached: torch.Tensor, atol: float) -> tuple[bool, bool]:
    """``(the same top token, a flip beyond atol)`` of finite last-token logits: a flip is a
    cached top token that scores more than ``atol`` below the uncached top token in the uncached
    logits (a near-tie within the tolerance may flip honestly)."""
    fresh, cached = fresh.reshape(-1), cached.reshape(-1)
    top_fresh, top_cached = int(fresh.argmax()), int(cached.argmax())
    if top_fresh == top_cached:
        return True, False
    margin = float(fresh[top_fresh].double() - fresh[top_cached].double())
    return False, margin > atol
