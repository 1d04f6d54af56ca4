#!/usr/bin/env python3
"""Two hosts of a prefill fleet on one shared store, end to end, as a user runs them.

For each store (one private ``redis-server``, then a 3-node Redis Cluster that ``redis-cli
--cluster create`` joins, both on loopback ports), host A replays a trace with its own disk tier
and the store behind it, then host B (another process, its own empty disk and L2) replays the
same trace: what A computed and published is B's hit, read from the store and verified. A third
run, host C, has no store at all (the baseline). Every replay runs ``--verify`` (sampled
requests recomputed uncached, payloads compared byte for byte). Prints a table, then one JSON
line. Needs Debian's ``redis-server`` and ``redis-tools`` (``scripts/setup.sh``).

    python scripts/shared-tier-fleet.py [--trace synthetic:0:300] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from redis_rig import RedisCluster, RedisServer  # noqa: E402  (the tests' real Redis servers)


def replay(trace: str, disk: Path, url: str | None, extra: list[str]) -> tuple[dict, float]:
    argv = [sys.executable, "-m", "kvstrata", "replay", "--model", "none", "--trace", trace]
    argv += ["--l1-tokens", "32768", "--l2-tokens", "65536", "--l3-dir", str(disk)]
    argv += ["--l3-gib", "1", "--verify", "20", "--json", "--no-progress", *extra]
    if url is not None:
        argv += ["--remote", url, "--remote-gib", "4"]
    t0 = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1]), time.monotonic() - t0


def row(store: str, host: str, s: dict, wall: float) -> dict:
    remote = s["tiers"].get("remote") or {}
    l3 = s["tiers"].get("l3") or {}
    return {
        "store": store,
        "host": host,
        "hit_ratio": s["hit_ratio"],
        "l3_hit_tokens": s["hit_tokens_by_tier"]["l3"],
        "pages_from_disk": l3.get("engine_from_disk_pages", 0),
        "pages_from_store": l3.get("engine_from_remote_pages", 0),
        "pages_published": remote.get("pages_written", 0),
        "verify_failures": remote.get("verify_failures", 0),
        "verify_ok": s["verify"]["ok"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "wall_s": round(wall, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="synthetic:0:300", help="the trace both hosts replay")
    ap.add_argument("--keep", type=Path, help="a directory to keep the disks and logs in")
    args, extra = ap.parse_known_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="kvstrata-fleet-"))
    rows = []
    base, wall = replay(args.trace, work / "c", None, extra)
    rows.append(row("none", "C", base, wall))
    for kind in ("standalone", "cluster"):
        server = RedisServer(work / kind) if kind == "standalone" else RedisCluster(work / kind)
        try:
            for host in ("A", "B"):
                s, wall = replay(args.trace, work / kind / host, server.url, extra)
                rows.append(row(kind, host, s, wall))
        finally:
            server.kill() if isinstance(server, RedisServer) else server.stop()
    cols = list(rows[0])
    print("  ".join(f"{c:>16}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]!s:>16}" for c in cols))
    print(json.dumps({"bench": "shared-tier-fleet", "trace": args.trace, "rows": rows}))
    ok = all(r["verify_ok"] and r["verify_failures"] == 0 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
