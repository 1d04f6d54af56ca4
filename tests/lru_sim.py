"""A page-level LRU reference for the engine's cache with one request at a time (issue 14, part 5).

The cache is a trie of pages: a page is identified by its parent page and its own tokens, so two
pages are the same exactly when their whole prefixes are. A partly filled last page (a *valid
tail*) is a page of fewer tokens: cached, never matched. Per request of ``n`` tokens (page size
``P``), as the engine runs it with ``max_batch_requests=1``:

1. **match**: walk whole cached pages, at most ``(n - 1) // P`` of them (the last token is always
   recomputed), and lock them;
2. **make room**: ``need = ceil(n / P) - matched``; when fewer than ``need`` pages are free, evict
   (below), then take ``need`` pages;
3. **record**: the clock ticks once; every matched page gets it;
4. **insert**: the clock ticks again; the request's pages already cached (the recomputed last page
   of an exact repeat, an identical valid tail) get it and their fresh copies are freed again; the
   new pages are added with it; unlock.

A request whose pages exceed the capacity is refused (``None``) and changes nothing.

Eviction, two variants:

* ``"tail_first"`` — what a radix tree should do: free exactly the deficit, one page at a time,
  always the unlocked leaf page with the oldest clock. Pages of one radix node share their clock
  and form a chain, so this trims the least recently used leaf node from its tail (the valid tail
  first); an emptied node's parent may then be the oldest leaf.
* ``"whole_leaf"`` — today's tree: remove whole least recently used leaf *nodes* until at least
  the deficit is free. Node boundaries depend on history, so this variant also tracks where the radix
  tree has split: a new leaf starts a node, and a match (or insert) that ends inside a node splits
  it there. It reproduces one more detail of today's tree: an insert records its access on whole
  nodes, so the rest of a node that the request's last page shares gets the clock too.

Every clock tick touches one root path, so two leaves never share a clock; the simulator asserts
it (and, for whole leaves, that a node's pages share one clock).

``python tests/lru_sim.py`` prints the hit ratios of both variants and of the engine on the
workloads and capacities the tests use.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np

EVICTIONS = ("tail_first", "whole_leaf")


class _Page:
    __slots__ = (
        "id",
        "parent",
        "key",
        "children",
        "clock",
        "locks",
        "alive",
        "starts_node",
        "cont",
    )

    def __init__(self, page_id: int, parent: _Page | None, key: bytes, clock: int) -> None:
        self.id = page_id
        self.parent = parent
        self.key = key  # this page's tokens (bytes); with the parent's id, its identity
        self.children = 0
        self.clock = clock
        self.locks = 0
        self.alive = True
        self.starts_node = True  # whole_leaf only: the first page of a radix node
        self.cont: _Page | None = None  # whole_leaf only: the next page of the same node


class LRUSim:
    """Replays requests one at a time on a cache of ``capacity_pages`` pages."""

    def __init__(self, page_size: int, capacity_pages: int, eviction: str = "tail_first") -> None:
        assert eviction in EVICTIONS, eviction
        self.page_size = page_size
        self.capacity = capacity_pages
        self.whole_leaf = eviction == "whole_leaf"
        self.root = _Page(0, None, b"", 0)
        self.index: dict[tuple[int, bytes], _Page] = {}
        self.clock = 0
        self.used = 0
        self._ids = itertools.count(1)
        self._heap: list[tuple[int, int, _Page]] = []  # (clock, id, leaf page), checked lazily

    # -- one request -----------------------------------------------------------------------------

    def run(self, tokens: np.ndarray) -> int | None:
        """Serve one request; return its cached tokens, or None when it is refused."""
        P, n = self.page_size, int(tokens.size)
        num_pages = -(-n // P)
        if num_pages > self.capacity:
            return None
        blocks = [tokens[i * P : (i + 1) * P].tobytes() for i in range(num_pages)]

        path: list[_Page] = []
        node = self.root
        for block in blocks[: (n - 1) // P]:
            page = self.index.get((node.id, block))
            if page is None:
                break
            path.append(page)
            node = page
        if self.whole_leaf and node.cont is not None:
            self._split_after(node)  # the match ends inside a node
        for page in path:
            page.locks += 1

        need = num_pages - len(path)
        short = need - (self.capacity - self.used)
        if short > 0:
            self._evict(short)
        assert self.capacity - self.used >= need
        self.used += need

        self.clock += 1
        for page in path:
            page.clock = self.clock
        self._insert(blocks, len(path))
        for page in path:
            page.locks -= 1
            self._push_if_leaf(page)
        return len(path) * P

    def _insert(self, blocks: list[bytes], matched: int) -> None:
        self.clock += 1
        clock = self.clock
        node, found = self.root, 0
        for block in blocks:
            page = self.index.get((node.id, block))
            if page is None:
                break
            page.clock = clock
            node, found = page, found + 1
        if self.whole_leaf:
            last = node
            while last.cont is not None:  # today's tree touches the whole last node
                last = last.cont
                last.clock = clock
            self._push_if_leaf(last)
        self._push_if_leaf(node)
        # Pages the request computed that the cache holds already are freed again.
        self.used -= found - matched
        fresh = blocks[found:]
        if not fresh:
            return
        if self.whole_leaf and node.cont is not None:
            self._split_after(node)
        parent = node
        for i, block in enumerate(fresh):
            page = _Page(next(self._ids), parent, block, clock)
            page.starts_node = i == 0
            if i > 0:
                parent.cont = page
            self.index[(parent.id, block)] = page
            parent.children += 1
            parent = page
        self._push_if_leaf(parent)

    def _split_after(self, page: _Page) -> None:
        """Today's tree splits the node holding ``page`` right after it."""
        assert page.cont is not None
        page.cont.starts_node = True
        page.cont = None

    # -- eviction --------------------------------------------------------------------------------

    def _push_if_leaf(self, page: _Page) -> None:
        if page is not self.root and page.alive and page.children == 0:
            heapq.heappush(self._heap, (page.clock, page.id, page))

    def _current(self, entry: tuple[int, int, _Page]) -> bool:
        clock, _, page = entry
        return page.alive and page.children == 0 and page.locks == 0 and page.clock == clock

    def _pop_oldest_leaf(self) -> _Page:
        heap = self._heap
        while heap and not self._current(heap[0]):
            heapq.heappop(heap)
        assert heap, "nothing evictable left: one request at a time always fits"
        clock, _, page = heapq.heappop(heap)
        while heap and (heap[0][2] is page or not self._current(heap[0])):
            heapq.heappop(heap)  # stale, or the same page queued twice
        assert not heap or heap[0][0] != clock, f"two leaves share clock {clock}"
        return page

    def _evict(self, short: int) -> None:
        freed = 0
        while freed < short:
            leaf = self._pop_oldest_leaf()
            victims = [leaf]
            if self.whole_leaf:
                while not victims[-1].starts_node:  # up to the first page of the leaf node
                    parent = victims[-1].parent
                    assert parent is not None
                    victims.append(parent)
                assert all(v.clock == leaf.clock for v in victims), "a node's pages share a clock"
            for page in victims:
                self._remove(page)
            freed += len(victims)
            parent = victims[-1].parent
            assert parent is not None
            self._push_if_leaf(parent)

    def _remove(self, page: _Page) -> None:
        parent = page.parent
        assert parent is not None and page.children == 0 and page.locks == 0
        del self.index[(parent.id, page.key)]
        parent.children -= 1
        if parent.cont is page:
            parent.cont = None
        page.alive = False
        self.used -= 1


def simulate(
    requests: Iterable[np.ndarray], page_size: int, capacity_pages: int, eviction: str
) -> list[int | None]:
    """Cached tokens per request (None: refused) of the simulator."""
    sim = LRUSim(page_size, capacity_pages, eviction)
    return [sim.run(tokens) for tokens in requests]


# -- random workloads ----------------------------------------------------------------------------


def random_workload(
    seed: int, n_requests: int, page_size: int, vocab: int = 8, max_pages: int = 12
) -> Iterator[np.ndarray]:
    """Requests that mostly extend, cut or repeat a recent one: exact repeats (with and without a
    partial last page), cuts at and between page boundaries, fresh prompts; tiny ``vocab`` makes
    equal pages under different prefixes common."""
    rng = np.random.default_rng(seed)
    recent: list[np.ndarray] = []
    P = page_size
    for _ in range(n_requests):
        roll = rng.random()
        if recent and roll < 0.85:
            base = recent[int(rng.integers(len(recent)))]
            if rng.random() < 0.4:
                cut = int(rng.integers(1, base.size // P + 1)) * P if base.size >= P else base.size
            else:
                cut = int(rng.integers(1, base.size + 1))
            extra = 0 if rng.random() < 0.2 else int(rng.integers(1, 3 * P))
            tokens = np.concatenate([base[:cut], rng.integers(0, vocab, extra, dtype=np.uint32)])
        else:
            tokens = rng.integers(0, vocab, int(rng.integers(1, 4 * P)), dtype=np.uint32)
        tokens = tokens[: max_pages * P].astype(np.uint32)
        recent = [*recent[-30:], tokens]
        yield tokens


@dataclass(frozen=True)
class Case:
    """A workload the equality tests replay."""

    name: str
    page_size: int
    vocab: int

    def requests(self) -> list[np.ndarray]:
        return [r.tokens for r in self.load()]

    def load(self) -> list:  # list[Request]; imported lazily so this file runs as a script
        from kvstrata.workloads import Request, agentic, synthetic
        from kvstrata.workloads.agentic import AgenticShape

        if self.name == "random":
            return [Request(i, t) for i, t in enumerate(random_workload(7, 2500, self.page_size))]
        if self.name == "agentic":
            # Sessions of 150-400 tokens: long enough to share deep prefixes, short enough that
            # 0.5 % of the unique tokens still holds most requests.
            shape = replace(AgenticShape(sessions=64).scaled(0.01), target_tokens=(150, 400))
            return list(agentic(1, 3000, self.vocab, shape))
        assert self.name == "synthetic"
        params = {"system_prompt_len": 24, "turn_min": 4, "turn_max": 24, "max_turns": 8}
        return synthetic(2, 2500, self.vocab, **params)


CASES = (Case("random", 4, 8), Case("agentic", 8, 1000), Case("synthetic", 4, 1000))
CAPACITY_FRACTIONS = (0.005, 0.01, 0.02, 0.05)


def unique_tokens(requests: list[np.ndarray], page_size: int) -> int:
    from kvstrata.benchmarks.workload import describe
    from kvstrata.workloads import Request

    return describe((Request(i, t) for i, t in enumerate(requests)), page_size).unique_tokens


def engine_hits(
    requests: list, page_size: int, capacity_pages: int, vocab: int, check: bool = False
) -> list[int | None]:
    """Cached tokens per request (None: refused) of the engine, one request at a time."""
    from kvstrata.engine import Engine, EngineConfig
    from kvstrata.model.compute import SyntheticCompute

    longest = max(r.tokens.size for r in requests)
    config = EngineConfig(
        page_size=page_size,
        pool_tokens=capacity_pages * page_size,
        chunk_size=longest,
        max_batch_tokens=longest,
        max_batch_requests=1,
        check_every_step=check,
    )
    engine = Engine(SyntheticCompute(4, vocab), config)
    out: list[int | None] = []
    for r in requests:
        engine.add(r)
        done = []
        while engine.has_work():
            done.extend(engine.step())
        (f,) = done
        out.append(None if f.error else f.cached_len)
    return out


def _ratio(hits: list[int | None], requests: list[np.ndarray]) -> str:
    served = [(h, t.size) for h, t in zip(hits, requests, strict=True) if h is not None]
    refused = len(hits) - len(served)
    ratio = sum(h for h, _ in served) / max(1, sum(n for _, n in served))
    return f"{ratio:.4f}" + (f" ({refused} refused)" if refused else "")


def main() -> None:
    for case in CASES:
        loaded = case.load()
        requests = [r.tokens for r in loaded]
        unique = unique_tokens(requests, case.page_size)
        print(f"{case.name}: {len(requests)} requests, page {case.page_size}, unique {unique:,}")
        print(f"  {'capacity':>18}  {'engine':>18}  {'tail_first':>18}  {'whole_leaf':>18}")
        for fraction in CAPACITY_FRACTIONS:
            pages = max(1, int(fraction * unique) // case.page_size)
            engine = engine_hits(loaded, case.page_size, pages, case.vocab)
            tail = simulate(requests, case.page_size, pages, "tail_first")
            whole = simulate(requests, case.page_size, pages, "whole_leaf")
            label = f"{fraction:.1%} = {pages} pages"
            print(
                f"  {label:>18}  {_ratio(engine, requests):>18}  {_ratio(tail, requests):>18}"
                f"  {_ratio(whole, requests):>18}"
            )


if __name__ == "__main__":
    main()
