"""The summary's reports: what the L2 and L3 tiers did (:class:`TierReport`), what ``--verify``
found (:class:`VerifyReport`) and what decoding from the handoffs found (:class:`DecodeReport`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..engine import Engine
from ..residency import Tier
from ..tiers.remote.behind_disk import RemoteBehindDisk


@dataclass
class VerifyReport:
    """What ``--verify`` found, and whether that is a failure (``ok``).

    max_abs_logit_diff: over the values finite on both sides (target; ``draft_*``: the draft's).
    argmax_agree: share of sampled requests whose cached and uncached argmax are the same token.
    argmax_flips: argmax disagreements the tolerance does not explain: the cached run's top token
        is more than ``atol`` below the uncached run's top token in the uncached logits (target
        and draft together). A near-tie may flip honestly in bf16 (measured: a margin of 0.008).
    nonfinite_logits: NaN/inf values of either side (each one is a failure).
    atol: the largest |logit difference| accepted: ``--verify-atol``, or :data:`VERIFY_ATOL`'s
        value for the model's dtype; None when payload bytes are compared (``--model none``).
    """

    requests: int = 0
    max_abs_logit_diff: float | None = None
    argmax_agree: float | None = None
    payload_mismatched_bytes: int | None = None
    nonfinite_logits: int | None = None
    draft_max_abs_logit_diff: float | None = None  # the draft model's, with --draft-model
    draft_argmax_agree: float | None = None
    decode: DecodeReport | None = None  # with --decode-tokens
    atol: float | None = None
    argmax_flips: int | None = None

    @property
    def ok(self) -> bool:
        """No non-finite logit, no mismatched payload byte, no logit difference above ``atol``
        and no argmax flip beyond it."""
        return not self.problems()

    def problems(self) -> list[str]:
        """Why the verification fails, one phrase per reason (none: it passes)."""
        out = []
        if self.nonfinite_logits:
            out.append(f"{self.nonfinite_logits:,} non-finite logit values")
        if self.payload_mismatched_bytes:
            out.append(f"{self.payload_mismatched_bytes:,} payload bytes mismatched")
        if self.atol is not None:
            for name, diff in (
                ("", self.max_abs_logit_diff),
                ("draft ", self.draft_max_abs_logit_diff),
            ):
                if diff is not None and diff > self.atol:
                    out.append(f"{name}max |logit diff| {diff:.3g} > tolerance {self.atol:g}")
        if self.argmax_flips:
            out.append(
                f"{self.argmax_flips} argmax flips beyond the tolerance {self.atol:g} (another "
                "top token than without the cache)"
            )
        return out

    def describe(self) -> str:
        if self.max_abs_logit_diff is None:
            return f"payload bytes mismatched {self.payload_mismatched_bytes:,}" + (
                "" if self.ok else " (FAIL)"
            )
        text = (
            f"max |logit diff| {self.max_abs_logit_diff:.3g}, argmax agree {self.argmax_agree:.3f}"
        )
        if self.draft_max_abs_logit_diff is not None:
            text += (
                f"; draft: max |logit diff| {self.draft_max_abs_logit_diff:.3g}, argmax agree "
                f"{self.draft_argmax_agree:.3f}"
            )
        if self.atol is not None:
            text += f" (tolerance {self.atol:g})"
        problems = self.problems()
        if self.nonfinite_logits:
            text += " over the finite values"
        return f"FAIL: {'; '.join(problems)}; {text}" if problems else text


@dataclass
class DecodeReport:
    """What ``--decode-tokens`` found: greedy decoding from each sampled request's handoff
    against decoding from a prefill of the same request with an empty cache.

    tokens_equal: requests whose decoded tokens (and, with a draft, the draft's verdict at every
        position) equal the uncached run's.
    acceptance_*: the draft's greedy acceptance rate (share of decoded positions where its
        greedy token equals the target's), over the sampled requests that hit the cache, from
        the cached prefill's handoff and from the uncached one (they must be equal); None
        without a draft or without hits.
    """

    requests: int
    tokens: int
    tokens_equal: int
    hit_requests: int
    acceptance_cached: float | None
    acceptance_uncached: float | None
    handoff_bytes: int

    def describe(self) -> str:
        text = (
            f"{self.tokens_equal}/{self.requests} requests decode the same {self.tokens} tokens "
            f"from the handoff as without the cache ({self.handoff_bytes:,} handoff bytes)"
        )
        if self.acceptance_cached is not None:
            text += (
                f"; draft acceptance on {self.hit_requests} requests with cache hits "
                f"{self.acceptance_cached:.4f}, without the cache {self.acceptance_uncached:.4f}"
            )
        return text


@dataclass
class TierReport:
    """What the L2 host tier did during a replay (``hit_tokens_by_tier`` and friends)."""

    l2_hit_tokens: int
    host_pages: int
    host_pages_cached_end: int
    d2h_pages: int
    d2h_bytes: int
    h2d_pages: int
    h2d_bytes: int
    backups_done: int  # backup tickets committed (one a settle at most)
    backups_skipped: int  # nodes not backed up (no host room)
    backups_failed: int  # nodes whose copy failed
    loads: int
    loads_failed: int
    load_back_wait_ms: float
    l3_hit_tokens: int = 0
    #: the disk store's counters (spills, reads, GC, errors) and, under ``engine_`` keys, what
    #: the engine did with it (its spills, reloads, pages, misses, refusals, hit tokens)
    l3: dict[str, int | str] | None = None  # counters, and the io_mode that ran
    remote: dict[str, int] | None = None  # the shared store's (behind or in place of the disk)
    backups_done_pages: int = 0
    backups_skipped_pages: int = 0
    backups_failed_pages: int = 0

    @classmethod
    def of(cls, engine: Engine) -> TierReport | None:
        stats, backups, loads = (
            engine.cache.transfer_stats(),
            engine.cache.backups,
            engine.cache.loads,
        )
        if stats is None or backups is None or loads is None or engine.cache.host_allocator is None:
            return None
        return cls(
            l2_hit_tokens=engine.hit_tokens[Tier.L2],
            host_pages=engine.cache.host_allocator.num_pages,
            host_pages_cached_end=engine.cache.tree.num_host_pages,
            d2h_pages=stats.d2h_pages,
            d2h_bytes=stats.d2h_bytes,
            h2d_pages=stats.h2d_pages,
            h2d_bytes=stats.h2d_bytes,
            backups_done=backups.stats.done,
            backups_skipped=backups.stats.skipped,
            backups_failed=backups.stats.failed,
            loads=loads.stats.loads,
            loads_failed=loads.stats.failed,
            load_back_wait_ms=round(loads.stats.wait_s * 1e3, 3),
            l3_hit_tokens=engine.hit_tokens[Tier.L3],
            l3=_disk_counters(engine),
            remote=_remote_counters(engine),
            backups_done_pages=backups.stats.done_pages,
            backups_skipped_pages=backups.stats.skipped_pages,
            backups_failed_pages=backups.stats.failed_pages,
        )

    def rows(self, cached_tokens: int) -> list[tuple[str, str]]:
        l3 = self.l3
        disk = (
            [
                (
                    "disk: spilled / reloaded pages",
                    f"{l3['pages_written']:,} / {l3['engine_reloaded_pages']:,} "
                    f"(verify failures {l3['verify_failures']}, write errors "
                    f"{l3['write_errors']}, GC {l3['gc_reclaimed']:,})",
                ),
                (
                    "disk: reload misses / refused pages",
                    f"{l3['engine_reload_misses']:,} / {l3['engine_reload_refused_pages']:,} "
                    f"(spills refused {l3['spills_refused']:,})",
                ),
            ]
            if l3 is not None
            else []
        )
        if l3 is not None and "engine_from_remote_pages" in l3:
            disk.append(
                (
                    "L3 reloaded pages from disk / remote",
                    f"{l3['engine_from_disk_pages']:,} / {l3['engine_from_remote_pages']:,}",
                )
            )
        r = self.remote
        if r is not None:
            disk.append(
                (
                    "remote: published / fetched pages",
                    f"{r['pages_written']:,} (+{r['pages_present']:,} there) / "
                    f"{r['reloaded_pages']:,} (misses {r['misses']:,}, verify failures "
                    f"{r['verify_failures']}, timeouts {r['timeouts']}, breaker opens "
                    f"{r['breaker_opens']}, writes skipped {r['writes_skipped']:,})",
                )
            )
        return disk + [
            (
                "hit tokens L1 / L2 / L3",
                f"{cached_tokens - self.l2_hit_tokens - self.l3_hit_tokens:,} / "
                f"{self.l2_hit_tokens:,} / {self.l3_hit_tokens:,}",
            ),
            (
                "host pages (end / total)",
                f"{self.host_pages_cached_end:,} / {self.host_pages:,}",
            ),
            (
                "moved d2h / h2d",
                f"{self.d2h_pages:,} pages {self.d2h_bytes / 2**20:,.1f} MiB / "
                f"{self.h2d_pages:,} pages {self.h2d_bytes / 2**20:,.1f} MiB",
            ),
            (
                "backups: tickets done / nodes skipped / failed",
                f"{self.backups_done:,} ({self.backups_done_pages:,} pages) / "
                f"{self.backups_skipped:,} ({self.backups_skipped_pages:,} pages) / "
                f"{self.backups_failed:,} ({self.backups_failed_pages:,} pages)",
            ),
            (
                "load-backs (failed), wait ms",
                f"{self.loads:,} ({self.loads_failed}), {self.load_back_wait_ms:.1f}",
            ),
        ]


def _disk_counters(engine: Engine) -> dict[str, int | str] | None:
    """The disk store's counters, what the engine did with L3 (``engine_`` keys: with the shared
    store behind the disk, both together; ``from_disk`` / ``from_remote`` split its reloaded
    pages), and its I/O mode, when it has one."""
    disk, store = engine.cache.disk, engine.cache.disk_store
    if disk is None or store is None:
        return None
    stats = store.stats()
    engine_counts = {f"engine_{k}": v for k, v in asdict(disk.stats).items()}
    out = dict(stats.counters) | engine_counts | {"io_mode": stats.io_mode}
    if isinstance(disk.store, RemoteBehindDisk):
        pair = disk.store.counters.snapshot()
        out |= {
            "engine_from_disk_pages": pair["reloaded_from_disk"],
            "engine_from_remote_pages": pair["reloaded_from_remote"],
        }
    return out


def _remote_counters(engine: Engine) -> dict[str, int] | None:
    """The shared store's counters and what the engine did with it, when it has one. In the
    disk's place, the engine's L3 counts are the shared store's; behind the disk, the pages it
    served (``reloaded_pages``) and what the pair did (``behind_disk_`` keys: reloads split,
    disk pages retried from it, ...)."""
    remote, disk = engine.cache.remote, engine.cache.disk
    if remote is None or disk is None:
        return None
    stats = remote.stats()
    own = dict(stats.counters) | {
        "writes_skipped": stats.writes_skipped,
        "used_bytes": stats.used_bytes,
    }
    if not isinstance(disk.store, RemoteBehindDisk):
        return own | asdict(disk.stats)
    pair = disk.store.counters.snapshot()
    return (
        own
        | {"reloaded_pages": pair["reloaded_from_remote"]}
        | {f"behind_disk_{k}": v for k, v in pair.items()}
    )
