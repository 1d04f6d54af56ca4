"""scripts/setup.sh picks torch by the machine: a CUDA build where nvidia-smi lists a GPU (kept if
present), the pinned CPU wheel elsewhere. Run dry (pip commands printed) with a fake nvidia-smi and
a fake venv python, so nothing is installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"


def _fake(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def _setup(tmp_path: Path, gpu: bool, torch_cuda: str, driver_cuda: str = "13.0") -> str:
    """Run setup.sh dry; ``torch_cuda`` is what the venv's torch reports ('cpu', 'none', '12.8')."""
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    bin_dir.mkdir()
    (venv / "bin").mkdir(parents=True)
    smi = (
        'if [ "$1" = -L ]; then echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"; exit 0; fi\n'
        f'echo "| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: {driver_cuda} |"\n'
        if gpu
        else "exit 9\n"
    )
    _fake(bin_dir / "nvidia-smi", smi)
    answer = "exit 1" if torch_cuda == "none" else f"echo {torch_cuda}"
    _fake(venv / "bin" / "python", f'if [ "$1" = -c ]; then {answer}; fi\n')
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "KVSTRATA_SETUP_DRY_RUN": "1",
        "KVSTRATA_VENV": str(venv),
    }
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("have", ["cpu", "none"])
def test_gpu_machine_gets_a_cuda_torch(tmp_path: Path, have: str) -> None:
    out = _setup(tmp_path, gpu=True, torch_cuda=have)
    assert "installing the CUDA build of torch 2.13.0" in out
    assert "--index-url https://download.pytorch.org/whl/cu130" in out
    assert ("pip uninstall -q -y torch" in out) == (have == "cpu")
    assert ".[hf,dev,gpu]" in out


def test_gpu_machine_keeps_its_cuda_torch(tmp_path: Path) -> None:
    out = _setup(tmp_path, gpu=True, torch_cuda="12.8")
    assert "keeping the CUDA build of torch already installed (CUDA 12.8)" in out
    assert "torch==" not in out


def test_older_driver_picks_an_older_cuda_build(tmp_path: Path) -> None:
    out = _setup(tmp_path, gpu=True, torch_cuda="cpu", driver_cuda="12.6")
    assert "whl/cu126" in out


def test_cpu_machine_gets_the_pinned_cpu_wheel_first(tmp_path: Path) -> None:
    out = _setup(tmp_path, gpu=False, torch_cuda="none")
    assert "no NVIDIA GPU; installing the pinned CPU torch 2.13.0" in out
    lines = [line for line in out.splitlines() if line.startswith("+ ")]
    assert any(line.endswith("pip install -q torch==2.13.0") for line in lines)
    assert "index-url" not in out
    pips = [line for line in lines if "pip install" in line]
    assert pips[-1].endswith("-e .[hf,dev]")  # kvstrata's own install is the last pip step


@pytest.mark.parametrize("gpu", [False, True])
def test_sglang_comes_without_its_dependencies_and_keeps_torch(tmp_path: Path, gpu: bool) -> None:
    out = _setup(tmp_path, gpu=gpu, torch_cuda="12.8" if gpu else "cpu")
    lines = [line for line in out.splitlines() if line.startswith("+ ")]
    (pinned,) = [line for line in lines if "sglang==" in line]
    assert "--no-deps" in pinned and "sglang==0.5.23" in pinned
    assert not any("torch" in line.split() or "torch==" in line for line in lines)  # kept
    assert lines.index(pinned) < len(lines) - 1  # kvstrata's own install stays the last step
