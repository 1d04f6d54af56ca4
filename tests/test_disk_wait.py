"""Requests parked behind disk reloads come back in ticket order (the reload issued first, first),
and behind one reload in the order they waited: the request whose read it was is admitted first."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from helpers import small_disk_config

from kvstrata.engine import Engine
from kvstrata.model.compute import SyntheticCompute
from kvstrata.residency import Tier
from kvstrata.workloads import Request


def test_parked_requests_come_back_in_ticket_order_then_waiting_order(tmp_path: Path) -> None:
    prefix_a = np.arange(1, 321, dtype=np.uint32)
    prefix_b = np.arange(401, 721, dtype=np.uint32)
    first = Engine(
        SyntheticCompute(8, 1000), small_disk_config(tmp_path, "clear"), model_id="none:8"
    )
    try:
        first.run([Request(0, prefix_a), Request(1, prefix_b)], check=True)
    finally:
        first.close()

    def ask(rid: int, prefix: np.ndarray) -> Request:
        return Request(rid, np.concatenate([prefix, [900 + rid, 5, 6]]).astype(np.uint32))

    # b first, then a: the reload of b's pages is issued first; each gets one follower.
    order = [ask(10, prefix_b), ask(11, prefix_a), ask(12, prefix_b), ask(13, prefix_a)]
    second = Engine(
        SyntheticCompute(8, 1000), small_disk_config(tmp_path, "load"), model_id="none:8"
    )
    admitted: list[int] = []  # request ids in the order they finished
    try:
        for r in order:
            second.add(r)
        for _ in range(100_000):
            if not second.has_work():
                break
            # Each needs one short chunk: it finishes in the step that admits it, and a step
            # returns what it finished in the order it admitted them.
            admitted += [f.rid for f in second.step()]
            second.check()
        second.drain()
    finally:
        second.close()
    assert second.cache.disk is not None and second.cache.disk.stats.reloads == 2
    assert admitted == [10, 12, 11, 13]
    assert second.hit_tokens[Tier.L3] == 2 * 320


def test_a_pending_reload_blocks_the_step_instead_of_spinning(tmp_path: Path) -> None:
    """A slow disk (each read takes 0.4 s): the request parked behind its reload comes back at
    the next step, which blocks on the read; the loop takes a handful of steps and the process
    burns far less CPU than the wall time (a spinning loop burns all of it)."""
    prefix = np.arange(1, 321, dtype=np.uint32)
    first = Engine(
        SyntheticCompute(8, 1000), small_disk_config(tmp_path, "clear"), model_id="none:8"
    )
    try:
        first.run([Request(0, prefix)])
    finally:
        first.close()
    second = Engine(
        SyntheticCompute(8, 1000), small_disk_config(tmp_path, "load"), model_id="none:8"
    )
    try:
        assert second.cache.disk is not None
        reader = second.cache.disk.store._reader
        real_read = reader.read

        def slow_read(*args: object, **kw: object) -> list[bool]:
            time.sleep(0.4)
            return real_read(*args, **kw)  # type: ignore[arg-type]

        reader.read = slow_read  # type: ignore[method-assign]
        second.add(Request(1, np.concatenate([prefix, [7, 8, 9]]).astype(np.uint32)))
        wall, cpu = time.perf_counter(), time.process_time()
        steps = 0
        while second.has_work():
            second.step()
            steps += 1
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        second.close()
    assert second.hit_tokens[Tier.L3] == 320
    assert steps <= 3, steps
    assert wall >= 0.4 and cpu < 0.5 * wall, (cpu, wall)
    assert second.cache.disk_wait_s >= 0.35
