"""The capacity planner's answers in the user's units (the summary's ``planner`` block): each
tier's size in GiB of the modeled model's KV, the compute the cache saved against no cache, and
whether an L3 hit beats recomputing its prefix.

Compute saved: a request of ``n`` prompt tokens served ``c`` from the cache computes ``n - c``
tokens over a ``c``-token prefix. Chunked or not, its attention scores ``(n**2 - c**2) / 2``
pairs against ``n**2 / 2`` without the cache, so the cache saves ``token x c + pair x c**2 / 2``
seconds of the cost model per request (the per-step and per-request terms are paid either way).

L3 against recompute: reading a token's KV from disk takes ``bytes per token / disk read rate``;
recomputing it, at a prefix of ``L`` tokens, ``token + pair x L / 2`` seconds. The disk hit pays
only when the disk reads faster than ``recompute tokens/s x KV bytes per token``: the break-even
disk bandwidth, evaluated at the workload's mean prompt length.
"""

from __future__ import annotations

from typing import Any

from ..clock import CostModel
from ..engine import Engine
from .cost import GIB, SimCost
from .state import _Tally


def _gib(tokens: int, bytes_per_token: int) -> float:
    return round(tokens * bytes_per_token / GIB, 6)


def planner_block(engine: Engine, tally: _Tally, cost: SimCost | None) -> dict[str, Any] | None:
    """The ``planner`` block of a run on the simulated clock (None on the wall clock)."""
    if cost is None:
        return None
    cache, P = engine.cache, engine.config.page_size
    bpt = cost.bytes_per_token
    l1 = cache.allocator.num_pages * P
    l2 = cache.host_allocator.num_pages * P if cache.host_allocator is not None else 0
    l3 = cache.disk.store.num_slots * P * engine.cp if cache.disk is not None else 0
    coster = cost.coster
    if cost.profile is not None:
        token_s, pair_s = cost.profile.token_s, cost.profile.pair_s
    else:
        assert isinstance(coster, CostModel)
        token_s, pair_s = 1.0 / coster.tokens_per_s, 0.0
    served = tally.requests - tally.failed
    no_cache_s = token_s * tally.prompt_tokens + pair_s * tally.prompt_sq / 2
    saved_s = token_s * tally.cached_tokens + pair_s * tally.cached_sq / 2
    mean_len = tally.prompt_tokens / served if served else 0.0
    per_token = token_s + pair_s * mean_len / 2
    break_even = bpt / per_token / 1e9
    read = coster.disk_read_gbps
    return {
        "model": cost.shape.name
        if cost.shape
        else (cost.profile.provenance.model if cost.profile else None),
        "kv_bytes_per_token": bpt,
        "tier_tokens": {"l1": l1, "l2": l2, "l3": l3},
        "tier_gib": {"l1": _gib(l1, bpt), "l2": _gib(l2, bpt), "l3": _gib(l3, bpt)},
        "tokens_saved": tally.cached_tokens,
        "compute_s_no_cache": round(no_cache_s, 6),
        "compute_s_saved": round(saved_s, 6),
        "compute_saved_share": round(saved_s / no_cache_s, 6) if no_cache_s else 0.0,
        "recompute_tokens_per_s": round(1.0 / per_token, 1),
        "at_prompt_tokens": round(mean_len, 1),
        "break_even_disk_read_gbps": round(break_even, 6),
        "disk_read_gbps": read,
        "l3_beats_recompute": read > break_even,
    }


def planner_rows(block: dict[str, Any] | None, has_l3: bool) -> list[tuple[str, str]]:
    """The table's rows for the ``planner`` block."""
    if block is None:
        return []
    gib = block["tier_gib"]
    sizes = " / ".join(
        f"{gib[t]:,.2f}" for t in ("l1", "l2", "l3") if block["tier_tokens"][t] or t == "l1"
    )
    tiers = "L1" + (" / L2" if block["tier_tokens"]["l2"] else "") + (" / L3" if has_l3 else "")
    what = block["model"] or f"{block['kv_bytes_per_token']:,} bytes/token"
    rows = [
        (
            f"tier sizes GiB ({tiers})",
            f"{sizes} of {what} KV ({block['kv_bytes_per_token']:,} B/token)",
        ),
        (
            "compute saved vs no cache",
            f"{block['compute_s_saved']:,.2f} of {block['compute_s_no_cache']:,.2f} s "
            f"({block['compute_saved_share']:.1%}), {block['tokens_saved']:,} tokens",
        ),
    ]
    if has_l3:
        verdict = (
            "L3 hits beat recompute"
            if block["l3_beats_recompute"]
            else "L3 HITS CANNOT BEAT RECOMPUTE here"
        )
        rows.append(
            (
                "L3 against recompute",
                f"{verdict}: recompute {block['recompute_tokens_per_s']:,.0f} tokens/s x "
                f"{block['kv_bytes_per_token']:,} B = break-even disk "
                f"{block['break_even_disk_read_gbps']:.3g} GB/s; disk reads "
                f"{block['disk_read_gbps']:g} GB/s",
            )
        )
    return rows
