#!/usr/bin/env bash
# The GPU measurements recorded in docs/benchmarks.md, in one call on a CUDA machine:
#   kvstrata bench gpu        ceilings, bare model, replay of 200 Mooncake conversation requests,
#                             TTFT of L1/L2 hits against recompute, write-through on/off (+ profiles)
#   kvstrata bench attention  the paged attention kernel's launch shapes against SDPA and flash
#   kvstrata bench prefill    our prefill against transformers at 1K, 8K and 32K tokens
# Usage: bash scripts/gpu-bench.sh TRACE OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
trace=${1:?trace file}; out=${2:?output folder}
export PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
python3 -m kvstrata.cli bench gpu --trace "$trace" --profile "$out/profiles" 2>&1 | tee "$out/bench_gpu.log"
python3 -m kvstrata.cli bench attention --sweep 2>&1 | tee "$out/attention.log"
python3 -m kvstrata.cli bench prefill --preset llama-3.2-1b --device cuda --lengths 1024 8192 32768 \
  --repeats 7 2>&1 | tee "$out/prefill.log"
