#!/usr/bin/env bash
# Create .venv and install kvstrata with its test and checkpoint extras; where apt is available (and
# we are root), Debian's chromium too, for the test that renders `replay --report`'s page
# (tests/test_report.py skips it, with the reason, where there is no browser).
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
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ]; then
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
      >/tmp/kvstrata-apt-chromium.log 2>&1; then
    echo "setup: apt-get install chromium failed (see /tmp/kvstrata-apt-chromium.log);" \
      "the browser test will skip" >&2
  fi
fi
