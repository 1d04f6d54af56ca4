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

from kvstrata.benchmarks.planneraccuracy import FIGURES, Window, _error, _get, build_parser, configs
from kvstrata.model.loader import read_model_config
from kvstrata.replay import run_replay

prof, trace, win, measured_file = sys.argv[1:5]
doc = json.loads(
    [ln for ln in Path(measured_file).read_text().splitlines() if ln.startswith("{")][-1]
)
# The benchmark's own flags and defaults; the device is this machine's (the predicted replay
# never touches it).
args = build_parser().parse_args(
    ["--device", "cpu", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--l1-tokens", "262144",
     "--l2-tokens", "1048576", "--on-error", "skip", "--cost-profile", prof]
)  # fmt: skip
limit = min(args.l1_tokens, read_model_config(args.model).max_position_embeddings)
with tempfile.TemporaryDirectory() as tmp:
    path, _ = Window.parse(win).write(Path(trace), Path(tmp), limit)
    for res in doc["results"]:
        scale = res["time_scale"]
        _, predicted_cfg = configs(args, str(path), scale)
        predicted = run_replay(predicted_cfg, progress=False).to_json()
        print(f"scale {scale:g}  profile {prof}")
        for row, (label, figure, how) in zip(res["rows"], FIGURES, strict=True):
            m, p = row["measured"], _get(predicted, figure)
            e = _error(m, p, how)
            print(
                f"  {label:<18} {m:>12,.1f} {p:>12,.1f} {e:+8.1%}"
                if how == "rel"
                else f"  {label:<18} {m:>12.4f} {p:>12.4f} {e:+.4f}"
            )
