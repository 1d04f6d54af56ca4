#!/usr/bin/env bash
# Create .venv and install kvstrata with its test and checkpoint extras.
# The pinned CPU torch goes in first, so the package's own range (torch>=2.4) is already met and pip
# never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q torch==2.13.0
fi
.venv/bin/python -m pip install -q -e ".[hf,dev]"
