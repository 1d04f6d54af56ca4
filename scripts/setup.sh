#!/usr/bin/env bash
# Create .venv and install kvstrata with its test and checkpoint extras.
#
# Which torch: on a machine without an NVIDIA GPU the pinned CPU torch goes in first, so the
# package's own range (torch>=2.4) is already met and pip never pulls a multi-GB CUDA build. On a
# machine where `nvidia-smi -L` lists a GPU, a CUDA build of torch is kept if the venv has one,
# and otherwise installed (replacing a CPU build) from the PyTorch index for the newest CUDA the
# driver supports; the gpu extra (Triton) comes with it. The script says which it chose.
# Then the pinned SGLang the HiCache storage backend is tested against (kvstrata.integrations.sglang,
# tests/test_sglang_*.py): installed --no-deps, because it declares a CUDA torch and GPU kernels
# that would replace the torch chosen here, plus the small pure-Python packages its storage and
# host-pool modules import (KVSTRATA_SKIP_SGLANG=1 leaves SGLang out; those tests then skip).
# Where apt is available (and we are root), Debian's chromium too, for the test that renders
# `replay --report`'s page (tests/test_report.py skips it, with the reason, where there is no browser),
# and Debian's redis-server and redis-tools (redis-cli, redis-benchmark) for the shared tier's tests,
# which start their own servers on free loopback ports (tests/redis_rig.py; they skip where there is
# none), and for `kvstrata bench remote`.
# Where cargo is on PATH, the peer of `kvstrata bench radix` (SGLang's Rust token tree,
# peers/sglang-tree), from Debian's packaged Rust crates; without cargo it says so and skips it.
#
# Environment: KVSTRATA_TORCH_INDEX=URL   the PyTorch index for the CUDA build (default: by driver)
#              KVSTRATA_SETUP_DRY_RUN=1   print the pip commands instead of running them
#              KVSTRATA_VENV=DIR          the virtual environment (default: .venv)
#              KVSTRATA_SKIP_SGLANG=1     do not install SGLang
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0
SGLANG_VERSION=0.5.23
# What sglang.srt.mem_cache's storage and host-pool modules import (versions where SGLang pins them).
SGLANG_NO_DEPS=("sglang==$SGLANG_VERSION" "compressed-tensors==0.18.0")
SGLANG_IMPORTS=(orjson psutil pybase64 requests starlette msgspec pyzmq ipython aiohttp dill
  "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" gguf loguru pydantic)
venv=${KVSTRATA_VENV:-.venv}
py=$venv/bin/python

run() {  # a pip step, or its command line on a dry run
  if [ "${KVSTRATA_SETUP_DRY_RUN:-0}" = 1 ]; then echo "+ $*"; else "$@"; fi
}

# The CUDA version the driver supports ("CUDA Version: 13.0" in nvidia-smi's header) -> an index.
cuda_index() {
  if [ -n "${KVSTRATA_TORCH_INDEX:-}" ]; then echo "$KVSTRATA_TORCH_INDEX"; return; fi
  local v major minor
  v=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\)\.\([0-9]*\).*/\1 \2/p' | head -1)
  read -r major minor <<<"${v:-0 0}"
  if [ "$major" -ge 13 ]; then echo https://download.pytorch.org/whl/cu130
  elif [ "$major" -eq 12 ] && [ "$minor" -ge 8 ]; then echo https://download.pytorch.org/whl/cu128
  elif [ "$major" -eq 12 ] && [ "$minor" -ge 6 ]; then echo https://download.pytorch.org/whl/cu126
  else
    echo "setup: the NVIDIA driver supports CUDA ${major}.${minor}; torch $TORCH_VERSION needs 12.6" \
      "or newer. Update the driver, or set KVSTRATA_TORCH_INDEX to a PyTorch index URL." >&2
    exit 2
  fi
}

if [ ! -x "$py" ]; then
  run python3 -m venv "$venv"
fi
run "$py" -m pip install -q --upgrade pip
# torch.version.cuda is None for a CPU build; "none" when torch is not installed.
have=$("$py" -c "import torch; print(torch.version.cuda or 'cpu')" 2>/dev/null || echo none)
install_sglang() {  # before kvstrata itself, whose install stays the last pip step
  if [ "${KVSTRATA_SKIP_SGLANG:-0}" = 1 ]; then return; fi
  echo "setup: sglang $SGLANG_VERSION without its dependencies (the torch above stays)"
  run "$py" -m pip install -q --no-deps "${SGLANG_NO_DEPS[@]}"
  run "$py" -m pip install -q "${SGLANG_IMPORTS[@]}"
}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  if [ "$have" != cpu ] && [ "$have" != none ]; then
    echo "setup: NVIDIA GPU found; keeping the CUDA build of torch already installed (CUDA $have)"
  else
    index=$(cuda_index)
    echo "setup: NVIDIA GPU found; installing the CUDA build of torch $TORCH_VERSION from $index" \
      "(the venv had: $have)"
    if [ "$have" = cpu ]; then run "$py" -m pip uninstall -q -y torch; fi
    run "$py" -m pip install -q "torch==$TORCH_VERSION" --index-url "$index"
  fi
  install_sglang
  run "$py" -m pip install -q -e ".[hf,dev,gpu]"
else
  if [ "$have" = none ]; then
    echo "setup: no NVIDIA GPU; installing the pinned CPU torch $TORCH_VERSION"
    run "$py" -m pip install -q "torch==$TORCH_VERSION"
  else
    echo "setup: no NVIDIA GPU; keeping the torch already installed ($have)"
  fi
  install_sglang
  run "$py" -m pip install -q -e ".[hf,dev]"
fi
if [ "${KVSTRATA_SETUP_DRY_RUN:-0}" != 1 ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ]; then
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
      >/tmp/kvstrata-apt-chromium.log 2>&1; then
    echo "setup: apt-get install chromium failed (see /tmp/kvstrata-apt-chromium.log);" \
      "the browser test will skip" >&2
  fi
fi
if [ "${KVSTRATA_SETUP_DRY_RUN:-0}" != 1 ] && ! command -v redis-server >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server \
      redis-tools; } >/tmp/kvstrata-apt-redis.log 2>&1; then
    echo "setup: apt-get install redis-server failed (see /tmp/kvstrata-apt-redis.log);" \
      "the shared-tier tests will skip" >&2
  fi
fi
# The peer of `kvstrata bench radix`: SGLang's Rust token tree (peers/sglang-tree). Its crates come
# from Debian's packaged Rust registry (no crate registry is reached), its tree's source from the
# pinned smg sdist on the package index (fetch_source.py, which checks its sha256).
PEER_CRATES=(librust-dashmap-dev librust-parking-lot-dev librust-once-cell-dev librust-rustc-hash-dev
  librust-tracing-dev librust-sha2-dev)
if [ "${KVSTRATA_SETUP_DRY_RUN:-0}" = 1 ]; then
  echo "+ apt-get install ${PEER_CRATES[*]}; $py peers/sglang-tree/fetch_source.py;" \
    "(cd peers/sglang-tree && cargo build --release)"
elif ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo is not on PATH; skipping the bench radix peer (peers/sglang-tree);" \
    "\`kvstrata bench radix\` will run without it and say so"
else
  if ! dpkg -s "${PEER_CRATES[@]}" >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
      && [ "$(id -u)" = 0 ]; then
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        "${PEER_CRATES[@]}"; } >/tmp/kvstrata-apt-rust.log 2>&1; then
      echo "setup: apt-get install of the peer's crates failed (see /tmp/kvstrata-apt-rust.log)" >&2
    fi
  fi
  # From the crate's folder: its .cargo/config.toml (Debian's registry) is found from there.
  if "$py" peers/sglang-tree/fetch_source.py \
      && (cd peers/sglang-tree && nice -n 10 cargo build -q --release); then
    echo "setup: built the bench radix peer, peers/sglang-tree/target/release/sglang-tree-bench"
  else
    echo "setup: building the bench radix peer failed (above); \`kvstrata bench radix\` will run" \
      "without it and say so" >&2
  fi
fi
