#!/usr/bin/env bash
# The GPU measurements recorded in docs/benchmarks.md, in one call on the device machine:
#   prefill tokens/s against transformers (Llama-3.2-1B shapes, bf16) at 1K, 8K and 32K tokens,
#   and a replay of 200 Mooncake conversation requests through the same model with --verify.
# Usage: bash scripts/gpu-bench.sh TRACE OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
trace=${1:?trace file}; out=${2:?output folder}
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
python3 -m kvstrata.cli bench prefill --preset llama-3.2-1b --device cuda --lengths 1024 8192 32768 \
  --repeats 7 2>&1 | tee "$out/prefill.log"
python3 -m kvstrata.cli replay --model llama-3.2-1b --device cuda --trace "$trace" --limit 200 \
  --l1-tokens 1048576 --max-batch-tokens 16384 --chunk-size 8192 --verify 8 --json --no-progress \
  2>&1 | tee "$out/replay.log"
