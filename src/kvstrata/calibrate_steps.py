"""``kvstrata calibrate --from-steps``: fit a profile's compute terms to a replay's own steps.

The designed calibration (:mod:`kvstrata.calibrate`) times steps it composes itself. A replay of
a real trace on the device runs steps the design may not cover (the H200's replay of the
conversation trace: batches of four or five 2,048-token chunks over prefixes of 20-160K tokens,
each backing its chunk up to L2 as it goes), and its step log (``kvstrata bench
planner-accuracy --steps-out DIR``) records each one's composition and measured seconds. This
fits the same terms (per step, request, token, pair, pair over a prefix, prefix token) to those
steps, by the same least squares on relative error, on every forward step that loaded nothing
back; a step's backups stay in the compute terms, as the replay paid them. The link rates, and
the pair term of requests without a prefix (a replay hardly has any), come from a base profile
(the designed one). Every fifth step is held back and predicted, as the
design's held-back set is.

Steps far slower than the first fit predicts (over ``OUTLIER`` x: a kernel compiled for a new
shape, a page fault storm) are left out of the second fit and counted; they are start-up, not
the step's cost.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from .calibrate import fit_compute, predict
from .clock import StepWork
from .cost import CostProfile
from .errors import ConfigError
from .replay.steps import read_steps

#: A step this many times slower than the first fit predicts is an outlier (left out, counted).
OUTLIER = 5.0
#: Every HOLD_BACK-th step is predicted, not fitted.
HOLD_BACK = 5


def _with_terms(profile: CostProfile, terms: tuple[float, ...]) -> CostProfile:
    step_s, request_s, token_s, pair_s, prefix_pair_s, prefix_s = terms
    return replace(
        profile, step_s=step_s, request_s=request_s, token_s=token_s, pair_s=pair_s,
        prefix_pair_s=prefix_pair_s, prefix_s=prefix_s,
    )  # fmt: skip


def _fit(
    base: CostProfile, works: list[StepWork], seconds: list[float], index: list[int]
) -> CostProfile:
    """The terms fitted on the steps ``index``, with the pair term of requests without a prefix
    held at ``base``'s: in a replay only a request's first chunk has none, so the log hardly
    sees the term (the H200's conversation logs fitted it at 7x the designed fresh prefills'),
    and a trace of long fresh prompts would pay for that guess."""
    fresh = [works[i].attention_pairs - works[i].prefix_pairs for i in index]
    # Without the fresh pairs their column is zero and its term comes out 0, replaced below.
    rest = [replace(works[i], attention_pairs=works[i].prefix_pairs) for i in index]
    y = [seconds[i] - base.pair_s * f for i, f in zip(index, fresh, strict=True)]
    terms = list(fit_compute(rest, y))
    terms[3] = base.pair_s
    return _with_terms(base, tuple(terms))


def fit_steps(
    paths: list[Path], base: CostProfile, name: str, command: str = ""
) -> tuple[CostProfile, dict[str, float]]:
    """A profile with ``base``'s links and the compute terms fitted to the forward steps of the
    step logs at ``paths``; also the counts and errors (held back, outliers)."""
    works: list[StepWork] = []
    seconds: list[float] = []
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"--from-steps {path}: no such file (a step log of --steps-out)")
        try:
            records = read_steps(path)
        except (ValueError, TypeError, KeyError) as err:
            raise ConfigError(f"--from-steps {path}: not a step log ({err})") from None
        for r in records:
            if r.requests and not r.h2d_bytes and r.seconds > 0:
                works.append(r.work())
                seconds.append(r.seconds)
    if len(works) < 4 * HOLD_BACK:
        raise ConfigError(
            f"--from-steps: {len(works)} forward steps without load-backs in "
            f"{', '.join(map(str, paths))}; the fit needs at least {4 * HOLD_BACK}"
        )
    fit = [i for i in range(len(works)) if i % HOLD_BACK]
    held = [i for i in range(len(works)) if not i % HOLD_BACK]
    first = _fit(base, works, seconds, fit)
    kept = [i for i in fit if seconds[i] <= OUTLIER * predict(first, works[i])]
    profile = _fit(base, works, seconds, kept)

    def errors(index: list[int]) -> list[float]:
        return [abs(predict(profile, works[i]) - seconds[i]) / seconds[i] for i in index]

    fitted, held_err = errors(kept), errors(held)
    stats = {
        "steps": len(works),
        "fitted": len(kept),
        "held_back": len(held),
        "outliers": len(fit) - len(kept),
        "mean": round(statistics.fmean(fitted), 4),
        "max": round(max(fitted), 4),
        "held_back_mean": round(statistics.fmean(held_err), 4),
        "held_back_max": round(max(held_err), 4),
    }
    provenance = replace(
        base.provenance,
        date=datetime.now().isoformat(timespec="seconds"),
        fit_error={k: stats[k] for k in ("mean", "max", "held_back_mean", "held_back_max")},
        steps=len(kept),
        command=command,
        note=(
            f"compute terms fitted to {len(kept)} replay steps of {', '.join(p.name for p in paths)}"
            f" ({stats['outliers']} outliers over {OUTLIER:g}x left out, {len(held)} held back);"
            f" links from {base.name}"
        ),
    )
    return replace(profile, name=name, kind="calibrated", provenance=provenance), stats
