#!/usr/bin/env bash
# CPU threads under contention (docs/benchmarks.md, "CPU threads"): `kvstrata replay` with 1 and
# 2 torch intra-op threads, on an otherwise idle machine and with one core kept busy by a spinning
# process. Prints one line per run: load, workload, threads, engine seconds, prefill tokens/s and
# the 1-minute load average when the run ended.
# Usage: bash scripts/cpu-threads.sh [REPEATS]      (KVSTRATA=path/to/kvstrata to pick the CLI)
set -euo pipefail
cd "$(dirname "$0")/.."
kv=${KVSTRATA:-.venv/bin/kvstrata}
reps=${1:-3}
workloads=("builtin:" "none-synthetic300:--model none --trace synthetic:0:300" "small-builtin24:--model small --limit 24")

run() {  # state label threads args...
  local state=$1 label=$2 threads=$3; shift 3
  # shellcheck disable=SC2068
  "$kv" replay --no-progress --json --threads "$threads" $@ | tail -1 | python3 -c "
import json, sys
d = json.load(sys.stdin)
load = open('/proc/loadavg').read().split()[0]
print(f'$state {\"$label\":<18} threads={$threads} engine_s={d[\"seconds\"]:.3f} '
      f'tokens_per_s={d[\"prefill_tokens_per_s\"]:.0f} loadavg={load}')"
}

spinner=
trap '[ -n "$spinner" ] && kill "$spinner"' EXIT
for state in idle busy; do
  if [ "$state" = busy ]; then python3 -c 'while 1: pass' & spinner=$!; sleep 1; fi
  for _ in $(seq "$reps"); do
    for w in "${workloads[@]}"; do
      for threads in 1 2; do run "$state" "${w%%:*}" "$threads" "${w#*:}"; done
    done
  done
  if [ -n "$spinner" ]; then kill "$spinner"; spinner=; fi
done
