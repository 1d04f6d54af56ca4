"""The ``--json`` summary's schema: the full nested key set of two fixed runs, and their config
blocks value by value, so that restructuring the replay cannot drop, rename or change a field
unnoticed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstrata.engine import EngineConfig
from kvstrata.errors import ConfigError
from kvstrata.replay import ReplayConfig, run_replay

#: Keys whose entries are data (strategy names, rank numbers), not schema.
DATA_KEYED = {"config.cp_attention_steps", "config.cp_bytes_per_rank"}


def key_paths(doc: dict[str, Any], prefix: str = "") -> set[str]:
    """Every key of ``doc``, nested ones as dotted paths."""
    out = set()
    for key, value in doc.items():
        path = f"{prefix}{key}"
        out.add(path)
        if isinstance(value, dict) and path not in DATA_KEYED:
            out |= key_paths(value, path + ".")
    return out


TOP = {
    "schema", "requests", "failed", "interrupted", "prompt_tokens", "cached_tokens", "hit_ratio",
    "computed_tokens", "prefill_tokens_per_s", "arrivals", "seconds", "cpu_seconds", "steps",
    "hit_tokens_by_tier", "hit_tokens_by_tier.l1", "hit_tokens_by_tier.l2",
    "hit_tokens_by_tier.l3",
    "pool", "pool.pages", "pool.pages_used_peak", "pool.pages_cached_end",
    "versions", "versions.kvstrata", "versions.torch", "versions.numpy", "versions.python",
    "clock", "clock.kind", "clock.seconds", "clock.cost",
    "ttft_ms", "ttft_ms.mean", "ttft_ms.p50", "ttft_ms.p90", "ttft_ms.p99",
    "ttft_parts_ms",
    *(f"ttft_parts_ms.{part}{q}" for part in ("queue", "load_back", "compute")
      for q in ("", ".mean", ".p50", ".p90", ".p99")),
    "ttft_by_hit_ms",
    *(f"ttft_by_hit_ms.{part}{q}" for part in ("cached", "recomputed")
      for q in ("", ".requests", ".mean", ".p50", ".p90", ".p99")),
    "tree", "tree.nodes", "tree.tokens", "tree.device_pages", "tree.host_pages", "tree.bytes",
    "tree.bytes_per_token",
    "tiers", "tiers.l2_hit_tokens", "tiers.host_pages", "tiers.host_pages_cached_end",
    "tiers.d2h_pages", "tiers.d2h_bytes", "tiers.h2d_pages", "tiers.h2d_bytes",
    "tiers.backups_done", "tiers.backups_skipped", "tiers.backups_failed", "tiers.loads",
    "tiers.loads_failed", "tiers.load_back_wait_ms", "tiers.l3_hit_tokens", "tiers.l3",
    "tiers.remote",  # new with --remote
    "tiers.backups_done_pages", "tiers.backups_skipped_pages", "tiers.backups_failed_pages",
    "verify", "verify.ok", "verify.requests", "verify.max_abs_logit_diff", "verify.argmax_agree",
    "verify.payload_mismatched_bytes", "verify.nonfinite_logits",
    "verify.draft_max_abs_logit_diff", "verify.draft_argmax_agree", "verify.decode",
    "verify.atol", "verify.argmax_flips",  # new with --verify's tolerance
    "planner", "clock.disk_wait_s", "clock.disk_busy_s", "clock.busy_s",  # with cost profiles
    "clock.startup_s",  # new with the clock started at the loop
}  # fmt: skip
CONFIG = {
    "workload", "limit", "skipped_lines", "model", "dtype", "vocab_size", "page_size",
    "l1_tokens", "l2_tokens", "l2_gib", "l3_dir", "l3_gib", "l3_start", "l3_min_hits",
    "host_layout", "write_policy", "write_through_hits", "chunk_size", "max_batch_tokens",
    "max_batch_requests", "lookahead", "eviction", "device", "kv_width", "verify",
    "draft_model", "decode_tokens", "handoff_dir", "seed", "threads", "arrivals", "time_scale",
    "clock", "cp", "cp_attention", "cp_attention_steps", "cp_bytes_per_rank", "attention",
}  # fmt: skip
#: Knobs the config block lacked while it was written key by key; derived from the dataclasses,
#: it names every one (None where it does not apply to the run).
CONFIG_ADDED = {
    "on_error", "metrics_port", "metrics_host", "cp_timeout_s", "check_every_step",
    "max_host_alloc_gib", "check_digests",
    "verify_atol",  # new with --verify-atol
    "cost_profile", "model_shape", "l1_gib", "sim_links",  # new with the cost profiles
    *(f"sim_links.{k}" for k in ("h2d_gbps", "d2h_gbps", "disk_read_gbps", "disk_write_gbps")),
    "remote", "remote_gib", "remote_timeout_ms", "remote_min_hits",  # new with --remote
    "remote_connections",  # new with --remote-connections
    "remote_publish_window",  # new with --remote-publish-window
    "l3_io",  # new with --l3-io
}  # fmt: skip
L3 = {
    "pages_present", "pages_written", "bytes_written", "pages_read", "bytes_read",
    "read_misses", "read_races", "verify_failures", "read_errors", "write_errors",
    "index_errors", "spills_refused", "gc_reclaimed", "spills",
    "skipped_admission", "skipped_full", "reloads", "load_pages", "load_dropped",
    "load_truncated", "dropped_unreported",
    # the engine's, apart from the store's (the same names used to overwrite the store's)
    "engine_spills", "engine_spilled_pages", "engine_spills_refused", "engine_reloads",
    "engine_reloaded_pages", "engine_reload_misses", "engine_reloads_refused",
    "engine_reload_refused_pages", "engine_hit_tokens",
    "io_mode",  # what --l3-io came to (auto: direct where the filesystem has it)
}  # fmt: skip
COST = {
    "tokens_per_s", "h2d_gbps", "d2h_gbps",
    "disk_read_gbps", "disk_write_gbps", "kind", "kv_bytes_per_token", "byte_scale",
}  # fmt: skip
PLANNER = {
    "model", "kv_bytes_per_token", "tier_tokens", "tier_gib", "tokens_saved",
    "compute_s_no_cache", "compute_s_saved", "compute_saved_share", "recompute_tokens_per_s",
    "at_prompt_tokens", "break_even_disk_read_gbps", "disk_read_gbps", "l3_beats_recompute",
    *(f"{t}.{k}" for t in ("tier_tokens", "tier_gib") for k in ("l1", "l2", "l3")),
}  # fmt: skip
DECODE = {
    "requests", "tokens", "tokens_equal", "hit_requests", "acceptance_cached",
    "acceptance_uncached", "handoff_bytes",
}  # fmt: skip
SCHEMA = TOP | {"config"} | {f"config.{k}" for k in CONFIG | CONFIG_ADDED}


def cache_only(l3_dir: Path) -> dict[str, Any]:
    """Every tier, a simulated clock, payload verification."""
    engine = EngineConfig(pool_tokens=4096, l2_tokens=8192, l3_dir=str(l3_dir), l3_gib=0.01)
    cfg = ReplayConfig(model="none", limit=24, verify=3, engine=engine)
    return run_replay(cfg, progress=False).to_json()


def with_model() -> dict[str, Any]:
    """A model with a draft, the wall clock, logits verification and decoding from handoffs."""
    engine = EngineConfig(page_size=16, pool_tokens=1024, chunk_size=128, l2_tokens=4096)
    cfg = ReplayConfig(
        model="tiny", draft_model="tiny-draft", limit=6, verify=2, decode_tokens=2, engine=engine
    )
    return run_replay(cfg, progress=False).to_json()


def test_cache_only_summary_keys_and_config(tmp_path: Path) -> None:
    doc = cache_only(tmp_path / "l3")
    expected = (
        SCHEMA
        | {f"tiers.l3.{k}" for k in L3}
        | {f"clock.cost.{k}" for k in COST}
        | {f"planner.{k}" for k in PLANNER}
    )
    assert key_paths(doc) == expected
    assert doc["config"] == {
        "workload": "builtin", "limit": 24, "skipped_lines": 0, "model": "none",
        "dtype": "uint8", "vocab_size": 128256, "page_size": 16, "l1_tokens": 4096,
        "l2_tokens": 8192, "l2_gib": 0.0, "l3_dir": str(tmp_path / "l3"), "l3_gib": 0.01,
        "l3_start": "clear", "l3_min_hits": 1, "l3_io": "auto", "host_layout": "page_first",
        "write_policy": "write_through", "write_through_hits": 2, "chunk_size": 2048,
        "max_batch_tokens": 8192, "max_batch_requests": 64, "lookahead": 128, "eviction": "lru",
        "device": "cpu", "kv_width": 64, "verify": 3, "draft_model": None, "decode_tokens": 0,
        "handoff_dir": None, "seed": 0, "threads": 1, "arrivals": "burst", "time_scale": 1.0,
        "clock": "sim", "cp": 1, "cp_attention": None, "cp_attention_steps": {},
        "cp_bytes_per_rank": {}, "attention": None,
        "on_error": "stop", "metrics_port": None, "metrics_host": None, "cp_timeout_s": None,
        "check_every_step": False, "max_host_alloc_gib": 480.0, "check_digests": None,
        "verify_atol": None, "cost_profile": None, "model_shape": None, "l1_gib": 0.0,
        "sim_links": dict.fromkeys(("h2d_gbps", "d2h_gbps", "disk_read_gbps", "disk_write_gbps")),
        "remote": None, "remote_gib": None, "remote_timeout_ms": None, "remote_min_hits": None,
        "remote_connections": None, "remote_publish_window": None,
    }  # fmt: skip


def test_model_summary_keys_and_config() -> None:
    doc = with_model()
    assert key_paths(doc) == SCHEMA | {f"verify.decode.{k}" for k in DECODE}
    assert doc["clock"]["cost"] is None and doc["tiers"]["l3"] is None
    assert doc["config"] == {
        "workload": "builtin", "limit": 6, "skipped_lines": 0, "model": "tiny",
        "dtype": "float32", "vocab_size": 512, "page_size": 16, "l1_tokens": 1024,
        "l2_tokens": 4096, "l2_gib": 0.0, "l3_dir": None, "l3_gib": None, "l3_start": None,
        "l3_min_hits": None, "l3_io": None, "host_layout": "page_first",
        "write_policy": "write_through", "write_through_hits": 2, "chunk_size": 128, "max_batch_tokens": 8192,
        "max_batch_requests": 64, "lookahead": 128, "eviction": "lru", "device": "cpu",
        "kv_width": None, "verify": 2, "draft_model": "tiny-draft", "decode_tokens": 2,
        "handoff_dir": None, "seed": 0, "threads": 1, "arrivals": "burst", "time_scale": 1.0,
        "clock": "wall", "cp": 1, "cp_attention": None, "cp_attention_steps": {},
        "cp_bytes_per_rank": {}, "attention": "auto",
        "on_error": "stop", "metrics_port": None, "metrics_host": None, "cp_timeout_s": None,
        "check_every_step": False, "max_host_alloc_gib": 480.0, "check_digests": None,
        "verify_atol": None, "cost_profile": None, "model_shape": None, "l1_gib": 0.0,
        "sim_links": dict.fromkeys(("h2d_gbps", "d2h_gbps", "disk_read_gbps", "disk_write_gbps")),
        "remote": None, "remote_gib": None, "remote_timeout_ms": None, "remote_min_hits": None,
        "remote_connections": None, "remote_publish_window": None,
    }  # fmt: skip


def test_l3_io_is_a_knob_and_the_summary_says_what_it_came_to(tmp_path: Path) -> None:
    """--l3-io buffered runs the disk tier through the page cache (the same hits and bytes as
    O_DIRECT: only the wall clock differs) and the summary says so; a bad value is refused."""
    docs = {}
    for io in ("buffered", "auto"):
        engine = EngineConfig(
            pool_tokens=4096, l2_tokens=8192, l3_dir=str(tmp_path / io), l3_gib=0.01, l3_io=io
        )
        cfg = ReplayConfig(model="none", limit=24, verify=3, engine=engine)
        docs[io] = run_replay(cfg, progress=False).to_json()
    assert docs["buffered"]["config"]["l3_io"] == "buffered"
    assert docs["buffered"]["tiers"]["l3"]["io_mode"] == "buffered"
    assert docs["auto"]["tiers"]["l3"]["io_mode"] in ("direct", "buffered")
    for key in ("hit_tokens_by_tier", "hit_ratio"):
        assert docs["buffered"][key] == docs["auto"][key]
    same = ("pages_written", "pages_read", "spills", "reloads")
    assert {k: docs["buffered"]["tiers"]["l3"][k] for k in same} == {
        k: docs["auto"]["tiers"]["l3"][k] for k in same
    }
    assert docs["buffered"]["verify"]["ok"]
    with pytest.raises(ConfigError, match="--l3-io must be one of auto, direct, buffered"):
        EngineConfig(l2_tokens=8192, l3_dir=str(tmp_path / "x"), l3_gib=0.01, l3_io="mmap")
