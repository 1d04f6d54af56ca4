"""What a replay is asked to do: :class:`ReplayConfig`, validated before anything is built, and
the names and costs derived from it."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..arrivals import ArrivalSpec
from ..clock import CostModel
from ..engine import EngineConfig
from ..errors import ConfigError
from ..limits import check_device
from ..model.attention import ATTENTION_BACKENDS
from ..model.identity import weights_id
from ..workloads import DEFAULT_VOCAB_SIZE

_MAX_SEED = 2**64 - 1  # torch generators take seeds up to 2**64 - 1


@dataclass(frozen=True)
class SimLinks:
    """``--sim-h2d-gbps``, ``--sim-d2h-gbps``, ``--sim-disk-read-gbps``,
    ``--sim-disk-write-gbps``: link rates that replace the cost model's (None keeps its own)."""

    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    disk_read_gbps: float | None = None
    disk_write_gbps: float | None = None


@dataclass(frozen=True)
class ReplayConfig:
    """Everything ``kvstrata replay`` needs; the CLI is a thin skin over this."""

    workload: str = "builtin"
    limit: int | None = None
    model: str = "tiny"  # a preset, a checkpoint directory, or "none"
    dtype: str | None = None
    kv_width: int = 64  # bytes per token with model "none"
    vocab_size: int = DEFAULT_VOCAB_SIZE  # token id range with model "none"
    engine: EngineConfig = field(default_factory=EngineConfig)
    verify: int = 0
    # The largest |logit difference| --verify accepts; None: VERIFY_ATOL's for the model's dtype.
    verify_atol: float | None = None
    on_error: str = "stop"
    seed: int = 0
    threads: int | None = None  # torch intra-op threads while replaying; None leaves torch's
    lookahead: int | None = None  # requests read ahead of the engine; None: 2 x max_batch_requests
    arrivals: ArrivalSpec = field(default_factory=ArrivalSpec)  # None kind: from the workload
    clock: str = "auto"  # auto (sim with model "none", else wall), wall or sim
    cost: CostModel | None = None  # the flat model (--sim-tokens-per-s); None: see replay/cost.py
    cost_profile: str | None = None  # a shipped profile's name or a profile JSON file
    model_shape: str | None = None  # with model "none": the model whose KV and cost it plans
    sim_links: SimLinks = field(default_factory=SimLinks)  # link rates replacing the model's
    l1_gib: float = 0.0  # L1 in GiB of KV instead of engine.pool_tokens (replay/cost.py's bytes)
    metrics_port: int | None = None  # serve Prometheus metrics on this port (0: any free one)
    metrics_host: str = "127.0.0.1"
    cp: int = 1  # context-parallel ranks (local processes, or torchrun's world)
    cp_timeout_s: float = 300.0  # every collective's timeout: a dead or hung rank fails the run
    attention: str = "auto"  # the model's attention backend (kvstrata.model.attention)
    draft_model: str | None = None  # a speculative draft prefilled on the same pages
    decode_tokens: int = 0  # greedy tokens decoded from each --verify request's handoff
    handoff_dir: str | None = None  # where CP ranks hand their parts over (decode under CP)

    def __post_init__(self) -> None:
        if isinstance(self.cp, bool) or not isinstance(self.cp, int) or not 1 <= self.cp <= 64:
            raise ConfigError(f"--cp must be an integer in [1, 64], got {self.cp!r}")
        if not 1 <= self.cp_timeout_s <= 86_400:
            raise ConfigError(
                f"--cp-timeout must lie in [1, 86400] seconds, got {self.cp_timeout_s!r}"
            )
        if not 0 <= self.seed <= _MAX_SEED:
            raise ConfigError(f"--seed must lie in [0, 2**64 - 1], got {self.seed}")
        check_device(self.engine.device)
        cores = os.cpu_count() or 1
        if self.threads is not None and not 1 <= self.threads <= cores:
            raise ConfigError(
                f"--threads must lie in [1, {cores}] (this machine's CPU cores), got {self.threads}"
            )
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.model == "none" and self.dtype is not None and self.model_shape is None:
            raise ConfigError(
                "--dtype applies to a model's K/V; --model none stores uint8 synthetic payloads "
                "(size them with --kv-width; --model-shape M --dtype D plans model M's KV in D)"
            )
        if self.model_shape is not None and self.model != "none":
            raise ConfigError(
                f"--model-shape plans a model's KV and cost without running it: it goes with "
                f"--model none (--model {self.model} runs the model itself)"
            )
        if not 0 <= self.l1_gib <= 2**20:
            raise ConfigError(f"--l1-gib must lie in [0, 1048576], got {self.l1_gib!r}")
        if self.cost is not None and self.cost_profile is not None:
            raise ConfigError(
                "--sim-tokens-per-s is the flat cost model; --cost-profile brings its own "
                "compute terms: give one of them"
            )
        if self.attention not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"--attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention!r}"
            )
        if self.vocab_size < 1:
            raise ConfigError(f"--vocab-size must be >= 1, got {self.vocab_size}")
        if self.verify < 0:
            raise ConfigError(f"--verify takes a number of requests >= 0, got {self.verify}")
        self._check_verify_atol()
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
        if self.clock not in ("auto", "wall", "sim", "cpu"):
            raise ConfigError(f"--clock must be auto, wall, sim or cpu, got {self.clock!r}")
        if self.clock == "cpu" and (self.engine.device != "cpu" or self.cp > 1):
            raise ConfigError(
                "--clock cpu times the replay thread's CPU: the CPU engine in one process only "
                "(--device cpu, no --cp)"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must lie in [0, 65535], got {self.metrics_port}")
        if not self.metrics_host.strip():
            raise ConfigError(
                "--metrics-host must name an address (127.0.0.1 by default; 0.0.0.0 for every "
                "interface)"
            )
        if self.draft_model is not None and self.model == "none":
            raise ConfigError(
                "--draft-model runs beside a model: give --model too (--model none has no draft)"
            )
        if self.draft_model == "":
            raise ConfigError("--draft-model needs a preset (e.g. tiny-draft) or a checkpoint")
        if not 0 <= self.decode_tokens <= 65_536:
            raise ConfigError(f"--decode-tokens must lie in [0, 65536], got {self.decode_tokens}")
        if self.decode_tokens and self.model == "none":
            raise ConfigError("--decode-tokens decodes with a model: give --model (not none)")
        if self.handoff_dir is not None and not self.decode_tokens:
            raise ConfigError(
                "--handoff-dir is where --decode-tokens hands each rank's part over: give "
                "--decode-tokens N (and --verify N) or drop it"
            )
        if self.decode_tokens and not self.verify:
            raise ConfigError(
                "--decode-tokens decodes from the handoff of each --verify request: give "
                "--verify N too"
            )
        if self.lookahead is not None and self.lookahead < self.engine.max_batch_requests:
            raise ConfigError(
                f"--lookahead ({self.lookahead}) must be >= --max-batch-requests "
                f"({self.engine.max_batch_requests}), or the engine could never fill a batch"
            )

    def _check_verify_atol(self) -> None:
        atol = self.verify_atol
        if atol is None:
            return
        if isinstance(atol, bool) or not isinstance(atol, (int, float)) or not math.isfinite(atol):
            raise ConfigError(f"--verify-atol must be a finite number >= 0, got {atol!r}")
        if atol < 0:
            raise ConfigError(f"--verify-atol must be >= 0, got {atol!r}")
        if self.model == "none":
            raise ConfigError(
                "--verify-atol bounds a model's logit differences; --model none compares "
                "payload bytes exactly"
            )
        if not self.verify:
            raise ConfigError("--verify-atol judges what --verify finds: give --verify N too")


def model_id(cfg: ReplayConfig) -> str:
    """What the cache's namespace and the handoff's fingerprint name the compute by."""
    if cfg.model == "none":
        return f"none:{cfg.kv_width}:{cfg.vocab_size}"
    return weights_id(cfg.model, cfg.seed, cfg.engine.device, cfg.draft_model)  # the weights


def uses_sim_clock(cfg: ReplayConfig) -> bool:
    """Whether the replay runs on the simulated clock (``auto``: with ``--model none``)."""
    return cfg.clock == "sim" or (cfg.clock == "auto" and cfg.model == "none")
