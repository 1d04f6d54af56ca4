"""The spill planner's one-loop plan (``SlotPool.touch_or_alloc``, ``remove_coldest``) against
the page-by-page plan it replaced, written out here: for any sequence of spills (pages repeated,
some published in between, a pool small enough for GC) both give the same batches, durable,
failed and victim pages, the same touched and pending pages, and the same LRU order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.tiers.disk_events import Counters, RateLimitedLog
from kvstrata.tiers.disk_plan import SpillJob, SpillPlanner
from kvstrata.tiers.disk_slots import SlotPool


def reference_plan(planner: SpillPlanner, job: SpillJob, dirty: dict[bytes, int]) -> None:
    """The plan as it was: a touch, a GC check and an allocation per page (``dirty``: the pages
    accessed since their index entry was written, as a dict)."""
    pool = planner.pool
    written = 0
    batch: list[tuple[bytes, int, int]] = []
    for h, host_slot in zip(job.hashes, job.host_slots, strict=True):
        if (found := pool.touch(h)) is not None:
            dirty[h] = found[0]
            if pool.writing_slot(h) is None:
                job.durable.append(h)
                continue
            batch.append((h, host_slot, -1))
        else:
            used = pool.num_used
            if used + 1 > planner.high_slots:
                for v, slot in pool.coldest(used - planner.low_slots):
                    last = pool.last_access(v)
                    pool.remove(v)
                    dirty.pop(v, None)
                    planner.pending[v] = slot
                    job.victims.append((v, slot, last))
                pool.sort_free()
            slot = pool.alloc(h)
            if slot is None:
                job.failed.append(h)
                continue
            batch.append((h, host_slot, slot))
            written += 1
            if written % planner.batch_pages == 0:
                job.batches.append(batch)
                batch = []
    if batch:
        job.batches.append(batch)
    job.pending = sum(len(b) for b in job.batches)


def planner(slots: int) -> SpillPlanner:
    return SpillPlanner(SlotPool(slots), slots - 1, slots // 2, 3, Counters(), RateLimitedLog())


spills = st.lists(
    st.tuples(st.lists(st.integers(0, 40), max_size=12), st.booleans()), min_size=1, max_size=25
)


#: Spills that never list a page twice: the bulk runs of ``touch_or_alloc`` (GC mid-spill, a
#: full pool and pages held between fresh ones included).
distinct_spills = st.lists(
    st.tuples(st.lists(st.integers(0, 60), max_size=16, unique=True), st.booleans()),
    min_size=1,
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(spills=spills | distinct_spills, slots=st.integers(4, 24))
def test_the_one_loop_plan_is_the_page_by_page_plan(
    spills: list[tuple[list[int], bool]], slots: int
) -> None:
    new, old = planner(slots), planner(slots)
    old_dirty: dict[bytes, int] = {}
    for ticket, (pages, publish) in enumerate(spills):
        jobs = []
        for p in (new, old):
            hashes = [bytes([n]) * 32 for n in pages]
            job = SpillJob(ticket, hashes, list(range(len(pages))), None, [])  # type: ignore[arg-type]
            if p is new:
                p.plan(job)
            else:
                reference_plan(p, job, old_dirty)
            jobs.append(job)
            if publish:  # the writer lands every planned page
                for batch in job.batches:
                    for h, _, slot in batch:
                        if slot >= 0:
                            p.pool.publish(h)
                p.victims_deleted(job)
        a, b = jobs
        assert (a.batches, a.durable, a.failed, a.victims, a.pending) == (
            b.batches, b.durable, b.failed, b.victims, b.pending
        )  # fmt: skip
        assert new.pool.live() == old.pool.live() and new.pool.clock == old.pool.clock
        assert new.pool.dirty_pages() == old_dirty and new.pending == old.pending
        assert new.pool.num_free == old.pool.num_free
        assert new.pool.coldest(slots) == old.pool.coldest(slots)
