"""``kvstrata replay``: run a workload through the engine and report what the cache saved.

Builds the compute (a model preset or checkpoint, or ``none`` for cache-only replay with synthetic
payloads), streams the workload's requests into the :class:`~kvstrata.engine.Engine` in order, a
bounded look-ahead window at a time (a finished request is folded into running totals and dropped,
so memory does not grow with the workload's length), and summarises: hit ratio, computed tokens,
prefill throughput, TTFT percentiles, pool usage, and — with ``--verify N`` — how far the cached
answers are from answers computed without the cache.

Everything that can be checked is checked before anything large is built: the configuration, then
the workload (a trace that cannot be opened, or has no request, fails before a model loads; a trace
line longer than the engine can ever serve is refused before its tokens are expanded; a malformed
line further on stops the replay when it is read, naming ``path:line``), then the memory the pool
and the weights need against what the device has. A Ctrl-C during the run ends it with the summary
of the requests finished so far (``interrupted``).

The summary is a :class:`ReplaySummary`; ``to_json()`` is the stable machine-readable form
(``SUMMARY_SCHEMA`` versions it).

One idea per module, imports pointing down the list:

==============  ==================================================================================
``config``      :class:`ReplayConfig`, validated; the model id derived from it
``cost``        which cost model the simulated clock runs on, in which bytes (profiles, shapes)
``feed``        the workload opened on rank 0, and the requests handed to every rank as they arrive
``build``       the compute, and the memory checks before anything large is allocated
``state``       a replay in progress (:class:`ReplayRun`), its running totals, its engine time
``reports``     what the tiers did, what ``--verify`` and decoding found
``summary``     :class:`ReplaySummary`: its config block, table and JSON
``verify``      ``--verify``: the sample, the uncached recompute, the comparison, the decoding
``loop``        :func:`run_replay`, one rank's run and the loop that feeds the engine
==============  ==================================================================================
"""

from __future__ import annotations

from .build import ComputeShape, build_compute, check_memory, compute_shape
from .config import ReplayConfig, SimLinks, model_id, uses_sim_clock
from .cost import (
    SimCost,
    describe_cost,
    kv_bytes_per_token,
    resolve_cost,
    resolve_sizes,
    tokens_for_gib,
)
from .feed import Feed, WorkloadSource, open_workload
from .loop import TRIM_EVERY_STEPS, _agree_on_config, release_free_heap, run_replay
from .reports import DecodeReport, TierReport, VerifyReport
from .state import LISTED_ERRORS, EngineTimer, ReplayObserver, ReplayRun, _Tally
from .summary import SUMMARY_SCHEMA, ReplaySummary, config_block
from .verify import (
    VERIFY_ATOL,
    VerifySample,
    compare_argmax,
    compare_logits,
    handoff_transport,
    prefill_uncached,
    recompute_uncached,
)

__all__ = [
    "LISTED_ERRORS",
    "SUMMARY_SCHEMA",
    "TRIM_EVERY_STEPS",
    "VERIFY_ATOL",
    "ComputeShape",
    "DecodeReport",
    "EngineTimer",
    "Feed",
    "ReplayConfig",
    "ReplayObserver",
    "ReplayRun",
    "ReplaySummary",
    "SimCost",
    "SimLinks",
    "TierReport",
    "VerifyReport",
    "VerifySample",
    "WorkloadSource",
    "_Tally",
    "_agree_on_config",
    "build_compute",
    "check_memory",
    "compare_argmax",
    "compare_logits",
    "compute_shape",
    "config_block",
    "describe_cost",
    "kv_bytes_per_token",
    "resolve_cost",
    "resolve_sizes",
    "tokens_for_gib",
    "uses_sim_clock",
    "handoff_transport",
    "model_id",
    "open_workload",
    "prefill_uncached",
    "recompute_uncached",
    "release_free_heap",
    "run_replay",
]
