"""Predict a measured ``kvstrata bench planner-accuracy`` run again with another cost profile, on
any machine (the predicted replay is ``--model none``): the measured figures come from the
benchmark's JSON line, the prediction is run here with the same sizes, chunking and arrivals.

    python scripts/planner_repredict.py PROFILE TRACE START:COUNT ACCURACY_OUTPUT

(the H200 defaults of the benchmark: Llama-3.2-1B bf16, --l1-tokens 262144 --l2-tokens 1048576,
--on-error skip).
"""

import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from kvstrata.benchmarks.planneraccuracy import FIGURES, Window, _error, _get, configs
from kvstrata.engine import EngineConfig
from kvstrata.replay import run_replay

prof, trace, win, measured_file = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
doc = json.loads(
    [ln for ln in Path(measured_file).read_text().splitlines() if ln.startswith("{")][-1]
)
d = EngineConfig()
args = SimpleNamespace(
    model="llama-3.2-1b",
    dtype="bfloat16",
    device="cpu",
    page_size=16,
    l1_tokens=262144,
    l2_tokens=1048576,
    chunk_size=d.chunk_size,
    max_batch_tokens=d.max_batch_tokens,
    max_batch_requests=d.max_batch_requests,
    attention="auto",
    seed=0,
    on_error="skip",
    cost_profile=prof,
)
with tempfile.TemporaryDirectory() as tmp:
    path, left = Window.parse(win).write(Path(trace), Path(tmp), 131072)
    for res in doc["results"]:
        sc = res["time_scale"]
        _, pc = configs(args, str(path), sc)
        r = run_replay(pc, progress=False).to_json()
        print(f"scale {sc:g}  profile {prof}")
        for row, (label, p, how) in zip(res["rows"], FIGURES, strict=True):
            m = row["measured"]
            pv = _get(r, p)
            e = _error(m, pv, how)
            print(
                f"  {label:<18} {m:>12,.1f} {pv:>12,.1f} {e:+8.1%}"
                if how == "rel"
                else f"  {label:<18} {m:>12.4f} {pv:>12.4f} {e:+.4f}"
            )
