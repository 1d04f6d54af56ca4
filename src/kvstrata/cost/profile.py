"""What one engine step costs on a device: :class:`CostProfile`, its terms, and its provenance.

A step computes the chunks of ``R`` requests, ``T`` tokens in all, where request ``i`` computes
``e_i`` tokens over ``p_i`` tokens already in its pages. Its compute lasts::

    step + request x R + token x T + pair x (A - B) + prefix_pair x B + prefix x C

    A = sum_i e_i x (p_i + e_i / 2),   B = the same sum over the requests with p_i > 0,
    C = sum_i p_i

``A`` counts the (query, key) pairs causal attention scores: each of the ``e_i`` new tokens
attends to the prefix and, on average, half of its own chunk. The per-token term is the model's
matmuls; the per-pair terms its attention's arithmetic, in the two kernels the engine runs: a
request from its first token attends to the K/V it has just computed with a causal flash kernel
(``pair``), one over a prefix reads its pages (the paged kernel on CUDA; on the CPU a gather and
SDPA under an explicit mask, which scores the masked pairs too: 10 ns a pair a layer against the
flash kernel's 6 here), ``prefix_pair``. Chunked prefill puts most of a long request's pairs in
the second kind. The per-prefix-token term is reading each chunk's cached prefix once (its KV's
bytes: what a short chunk over a long prefix is bound by, and on the CPU the gather out of the
pages), the per-step and per-request terms what a step pays whatever its size (scheduling, the
batch's page tables, kernel launches, the last-token logits). A profile without
``prefix_pair_s`` (calibrated before it existed) charges both kinds at ``pair_s``, and
:meth:`CostProfile.describe` says so.

The tier links move ``h`` bytes host -> device (load-back), ``d`` bytes device -> host
(write-through backup) and, on the disk, reads and writes. How the copies overlap the compute is
what the engine really does (``overlap``):

* ``layered`` (CUDA): load-back is copied layer by layer on its own stream and layer ``i``
  waits only for its own copy; each layer's backup starts once the layer wrote its KV. With
  ``L`` layers, per-layer times ``l = h / h2d / L``, ``c = (token + pair terms) / L`` and
  ``d = d / d2h / L`` form a three-stage pipeline::

      step + request x R  +  l + c + d + (L - 1) x max(l, c, d)

* ``serial`` (the CPU pools): copies are synchronous, so the step lasts the sum.

The disk runs beside the steps (the store's threads) and the engine waits for it at the next
step's fixed point (docs/design.md, "L3 disk format": back-pressure). A step's disk reads and
writes therefore queue on the disk from the step that issued them, and the next step begins
only once they are done: that wait is the *disk wait*.

A profile is fitted to the real engine on a device (``kvstrata calibrate``), or estimated from a
model's shape and the device's matmul rate (``kind="estimate"``), or the flat tokens/s model the
planner had before (``kind="flat"``: a per-token term only). Its :class:`Provenance` says which,
on what, when, and how well the fit held. Profiles are JSON files; those kvstrata ships live in
``kvstrata/cost/profiles/`` and load by name.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal, NamedTuple

from ..errors import ConfigError

#: 1: the first format.
PROFILE_FORMAT = 1
Overlap = Literal["layered", "serial"]
ProfileKind = Literal["calibrated", "estimate", "flat"]
OVERLAPS: tuple[Overlap, ...] = ("layered", "serial")
KINDS: tuple[ProfileKind, ...] = ("calibrated", "estimate", "flat")
GB = 1e9  # link rates are GB/s of 10**9 bytes, as dd and nvidia-smi write them

#: Disk rates per device kind when nothing measured them for a profile: ``dd`` with O_DIRECT,
#: 1 GiB, on the machines of docs/benchmarks.md ("Disk tier"): the 2-core development machine
#: (medians of its rounds: read 1.31, write 2.0 GB/s) and the H200 machine (read 2.04, write 1.3).
DISK_DEFAULTS: dict[str, tuple[float, float]] = {"cpu": (1.31, 2.0), "cuda": (2.04, 1.3)}


@dataclass(frozen=True)
class Provenance:
    """Where a profile's numbers come from."""

    device: str  # e.g. "NVIDIA H200" or "cpu: 2 cores, x86_64"
    device_kind: str  # "cpu" or "cuda": which engine paths (and overlap) it measured
    model: str  # the preset or checkpoint the engine ran (or whose shape was estimated)
    dtype: str
    page_size: int
    versions: dict[str, str] = field(default_factory=dict)  # kvstrata, torch, python, ...
    date: str = ""  # ISO 8601
    #: how well the fit held: mean / max relative error over the fitted and held-back steps
    fit_error: dict[str, float] = field(default_factory=dict)
    steps: int = 0  # steps the fit saw
    command: str = ""  # what produced it
    note: str = ""


class StepCost(NamedTuple):
    """One simulated step: its length, and the parts of it spent waiting for the disk (before
    the step could begin) and for load-back copies."""

    seconds: float
    disk_wait_s: float
    load_wait_s: float


@dataclass(frozen=True)
class CostProfile:
    """A step cost model's parameters (seconds, GB/s) and where they come from."""

    name: str
    kind: ProfileKind
    step_s: float  # per step that runs a forward
    request_s: float  # per request in the step
    token_s: float  # per computed token (all layers)
    pair_s: float  # per attention pair (all layers)
    prefix_s: float  # per cached prefix token a chunk's attention reads (all layers)
    h2d_gbps: float
    d2h_gbps: float
    disk_read_gbps: float
    disk_write_gbps: float
    overlap: Overlap
    num_layers: int  # the pipeline's depth under "layered" overlap
    kv_bytes_per_token: int  # of the model and dtype profiled (the planner's byte unit)
    provenance: Provenance
    format: int = PROFILE_FORMAT
    #: per attention pair of a request over a prefix (all layers); None: a profile calibrated
    #: before the term existed, which charges those pairs at ``pair_s``
    prefix_pair_s: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"cost profile {self.name!r}: kind must be one of {KINDS}")
        if self.overlap not in OVERLAPS:
            raise ConfigError(f"cost profile {self.name!r}: overlap must be one of {OVERLAPS}")
        for name in ("step_s", "request_s", "token_s", "pair_s", "prefix_s", "prefix_pair_s"):
            value = getattr(self, name)
            if name == "prefix_pair_s" and value is None:
                continue
            if not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ConfigError(
                    f"cost profile {self.name!r}: {name} must be a finite number >= 0, "
                    f"got {value!r}"
                )
        for name, flag in (
            ("h2d_gbps", "--sim-h2d-gbps"),
            ("d2h_gbps", "--sim-d2h-gbps"),
            ("disk_read_gbps", "--sim-disk-read-gbps"),
            ("disk_write_gbps", "--sim-disk-write-gbps"),
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(
                    f"{flag} (cost profile {self.name!r}: {name}) must be a positive number, "
                    f"got {value!r}"
                )
        if self.token_s + self.pair_s <= 0:
            raise ConfigError(f"cost profile {self.name!r}: computing a token must cost something")
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ConfigError(f"cost profile {self.name!r}: num_layers must be >= 1")
        if not isinstance(self.kv_bytes_per_token, int) or self.kv_bytes_per_token < 1:
            raise ConfigError(f"cost profile {self.name!r}: kv_bytes_per_token must be >= 1")
        if self.format != PROFILE_FORMAT:
            raise ConfigError(
                f"cost profile {self.name!r} has format {self.format}; this kvstrata reads "
                f"format {PROFILE_FORMAT}: calibrate it again"
            )

    # -- the model -------------------------------------------------------------------------------

    def step(
        self,
        requests: int,
        tokens: int,
        pairs: float,
        h2d_bytes: float,
        d2h_bytes: float,
        prefix_tokens: int = 0,
        prefix_pairs: float = 0.0,
    ) -> tuple[float, float]:
        """``(seconds, load-back wait)`` of a step that also copies ``h2d_bytes`` and
        ``d2h_bytes`` (bytes of this profile's KV); ``prefix_pairs`` is the part of ``pairs``
        of requests over a prefix."""
        load = h2d_bytes / (self.h2d_gbps * GB)
        back = d2h_bytes / (self.d2h_gbps * GB)
        if requests == 0:
            return load + back, load
        fixed = self.step_s + self.request_s * requests
        prefix_pair = self.pair_s if self.prefix_pair_s is None else self.prefix_pair_s
        attention = self.pair_s * (pairs - prefix_pairs) + prefix_pair * prefix_pairs
        layered = self.token_s * tokens + attention + self.prefix_s * prefix_tokens
        if self.overlap == "serial":
            return fixed + load + layered + back, load
        n = self.num_layers
        c, d = layered / n, back / n
        without_load = c + d + (n - 1) * max(c, d)
        total = load / n + c + d + (n - 1) * max(load / n, c, d)
        return fixed + total, total - without_load

    def with_links(self, **rates: float | None) -> CostProfile:
        """This profile with the given link rates (``h2d_gbps=...``; None keeps its own)."""
        given: dict[str, Any] = {k: v for k, v in rates.items() if v is not None}
        return replace(self, **given) if given else self

    def describe(self) -> str:
        """One line: the name, its kind, and what it was measured on."""
        p = self.provenance
        what = {"calibrated": "calibrated", "estimate": "ESTIMATE", "flat": "flat tokens/s"}[
            self.kind
        ]
        err = f", fit error {p.fit_error['mean']:.1%}" if "mean" in p.fit_error else ""
        return f"{self.name} ({what}: {p.model} {p.dtype} on {p.device}{err}{self.missing()})"

    def missing(self) -> str:
        """What this profile lacks, in words (empty when it has every term)."""
        if self.prefix_pair_s is None and self.kind != "flat":
            return (
                "; no prefix_pair_s (calibrated before the term existed): pairs over a prefix "
                "charged at pair_s, recalibrate"
            )
        return ""

    # -- JSON ------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "profile") -> CostProfile:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: a cost profile is a JSON object")
        known = {f.name for f in fields(cls)}
        missing = sorted(known - set(data) - {"format", "prefix_pair_s"})
        unknown = sorted(set(data) - known)
        if missing or unknown:
            raise ConfigError(
                f"{where}: not a kvstrata cost profile (missing {missing}, unknown {unknown})"
            )
        prov = data["provenance"]
        if not isinstance(prov, dict):
            raise ConfigError(f"{where}: provenance must be an object")
        pknown = {f.name for f in fields(Provenance)}
        try:
            provenance = Provenance(**{k: v for k, v in prov.items() if k in pknown})
            return cls(**(data | {"provenance": provenance}))
        except TypeError as err:
            raise ConfigError(f"{where}: {err}") from None

    def save(self, path: str | Path) -> Path:
        out = Path(path)
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
            tmp.replace(out)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise ConfigError(f"cannot write the cost profile {out}: {err.strerror}") from None
        return out


def shipped_profiles() -> dict[str, CostProfile]:
    """The profiles inside the package, by name."""
    out = {}
    for entry in resources.files(__package__).joinpath("profiles").iterdir():
        if entry.name.endswith(".json"):
            profile = CostProfile.from_json(json.loads(entry.read_text()), entry.name)
            out[profile.name] = profile
    return out


def load_profile(name_or_path: str) -> CostProfile:
    """A shipped profile by name, or a profile JSON file (what ``--cost-profile`` takes)."""
    shipped = shipped_profiles()
    if name_or_path in shipped:
        return shipped[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(
            f"--cost-profile {name_or_path!r} is neither a shipped profile "
            f"({', '.join(sorted(shipped))}) nor a file; make one with kvstrata calibrate"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"--cost-profile {path}: not a JSON cost profile ({err})") from None
    return CostProfile.from_json(data, str(path))


def find_shipped(device_kind: str, model: str, dtype: str) -> CostProfile | None:
    """The shipped profile measured for ``model`` in ``dtype`` on a ``device_kind`` device."""
    for profile in shipped_profiles().values():
        p = profile.provenance
        if profile.kind != "flat" and (p.device_kind, p.model, p.dtype) == (
            device_kind,
            model,
            dtype,
        ):
            return profile
    return None
