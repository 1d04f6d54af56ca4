"""Paged attention: the Triton kernel against the SDPA path (the CPU oracle), and backend choice.

On CPU the kernel runs in Triton's interpreter (slow, in a subprocess); on a CUDA machine the gpu
tests run it compiled, in bf16 and fp32, and the model and engine on top of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstrata.errors import ConfigError
from kvstrata.model.attention import PagedAttention
from kvstrata.model.attention_kernel import AttentionKernelConfig
from kvstrata.model.batch import ForwardBatch

CPU = torch.device("cpu")
KERNELS = [
    AttentionKernelConfig(16, 16, 1, 1, True),
    AttentionKernelConfig(32, 16, 2, 2, False),
    AttentionKernelConfig(64, 32, 4, 3, True),
]


def random_case(
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    max_len: int = 40,
) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of 1-4 requests with random prefixes, page size and shuffled slots; the extend K/V
    already written into random pages. Returns ``(batch, q, k, v, k_pages, v_pages)``."""
    gen = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    page = [1, 3, 4, 16][draw(0, 3)]
    requests = [(draw(0, max_len), draw(1, max_len)) for _ in range(draw(1, 4))]
    pages = [-(-(p + e) // page) for p, e in requests]
    slots = torch.randperm(sum(pages) + 5, generator=gen)
    tables, used = [], 0
    for n in pages:
        tables.append(slots[used : used + n])
        used += n
    batch = ForwardBatch.build(
        [p for p, _ in requests], [e for _, e in requests], tables, page, device
    )
    shape = (slots.numel(), page, kv_heads, head_dim)
    k_pages = torch.randn(shape, generator=gen).to(device, dtype)
    v_pages = torch.randn(shape, generator=gen).to(device, dtype)
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(batch.num_tokens, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(batch.num_tokens, kv_heads, head_dim, generator=gen).to(device, dtype)
    k_pages.view(-1, kv_heads, head_dim).index_copy_(0, batch.write_index, k)
    v_pages.view(-1, kv_heads, head_dim).index_copy_(0, batch.write_index, v)
    return batch, q, k, v, k_pages, v_pages


def reference_lse(
    batch: ForwardBatch, q: torch.Tensor, k_pages: torch.Tensor, scale: float
) -> torch.Tensor:
    """``[T, heads]`` log-sum-exp of each query's scaled causal scores, in float64."""
    heads, kv_heads = q.shape[1], k_pages.shape[2]
    rows = k_pages.view(-1, kv_heads, k_pages.shape[-1])
    out = []
    cu = batch.cu_seqlens_host
    for i, prefix in enumerate(batch.prefix_lens):
        keys = rows[batch.read_index[i]].double().repeat_interleave(heads // kv_heads, dim=1)
        queries = q[cu[i] : cu[i + 1]].double()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        n_q, n_k = queries.shape[0], keys.shape[0]
        visible = torch.arange(n_k)[None, :] <= (prefix + torch.arange(n_q))[:, None]
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        out.append(torch.logsumexp(scores, dim=-1).transpose(0, 1))
    return torch.cat(out)


# -- backend choice (CPU) ------------------------------------------------------------------------


def test_auto_is_sdpa_on_cpu_and_names_are_checked() -> None:
    assert PagedAttention.for_device("auto", CPU, 64).backend == "sdpa"
    assert PagedAttention.for_device("sdpa", CPU, 64).backend == "sdpa"
    with pytest.raises(ConfigError, match="--attention must be one of"):
        PagedAttention.for_device("flash", CPU, 64)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="the interpreter runs on CPU"
)
def test_triton_on_cpu_is_refused_not_replaced() -> None:
    pytest.importorskip("triton")
    with pytest.raises(ConfigError, match="CUDA only.*--attention sdpa"):
        PagedAttention.for_device("triton", CPU, 64)


def test_sdpa_path_is_lse_free() -> None:
    batch, q, k, v, kp, vp = random_case(0, CPU, torch.float32)
    with pytest.raises(ConfigError, match="triton"):
        PagedAttention("sdpa")(q, k, v, kp, vp, batch, lse=torch.empty(q.shape[:2]))


def test_model_rejects_unknown_backend() -> None:
    from kvstrata.model.loader import load_model

    _, model = load_model("tiny", device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match="--attention"):
        model.use_attention("fast")


# -- the kernel in Triton's interpreter (CPU) ----------------------------------------------------

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import sys, math, torch
    sys.path.insert(0, sys.argv[1])
    import triton_interpreter
    triton_interpreter.patch_loop_bounds()  # the kernel's loop bounds are loaded values
    import test_attention as ta
    from kvstrata.model.attention import PagedAttention
    cpu = torch.device("cpu")
    worst = 0.0
    for seed in range(12):
        kernel = ta.KERNELS[seed % len(ta.KERNELS)]
        batch, q, k, v, kp, vp = ta.random_case(seed, cpu, torch.float32)
        expected = PagedAttention("sdpa")(q, k, v, kp, vp, batch)
        lse = torch.full(q.shape[:2], float("nan"))
        got = PagedAttention("triton", kernel)(q, k, v, kp, vp, batch, lse=lse)
        worst = max(worst, float((got - expected).abs().max()))
        mixed = PagedAttention("triton", kernel)(q, k, v, kp, vp, batch)  # fresh ones: SDPA
        worst = max(worst, float((mixed - expected).abs().max()))
        ref = ta.reference_lse(batch, q, kp, 1 / math.sqrt(q.shape[-1]))
        assert torch.allclose(lse.double(), ref, atol=1e-4), (seed, (lse.double() - ref).abs().max())
    assert worst < 1e-5, worst
    # The whole model with the kernel equals the model with SDPA (fp32).
    from kvstrata.model.loader import load_model
    _, model = load_model("tiny", device="cpu", dtype="float32", seed=0)
    import test_model as tm
    config = model.config
    ids = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    (table,) = tm._page_tables([37], 64)
    out = {}
    for backend in ("sdpa", "triton"):
        model.use_attention(backend)
        pool = tm._pool(config)
        model(ids[:20], tm.ForwardBatch.build([0], [20], [table], tm.PAGE), pool)
        out[backend] = model(ids[20:], tm.ForwardBatch.build([20], [17], [table], tm.PAGE), pool, logits="all")
    assert torch.allclose(out["sdpa"], out["triton"], atol=1e-4), (out["sdpa"] - out["triton"]).abs().max()
    print("interpreted attention kernel: ok", worst)
    """
)


@pytest.mark.slow
def test_kernel_matches_sdpa_in_the_interpreter() -> None:
    """Random batches (1-4 requests, prefixes 0-40, page sizes 1/3/4/16, shuffled slots, GQA),
    every kernel shape: the interpreted kernel's output and LSE equal SDPA's and float64's; the
    tiny model with the kernel equals the model with SDPA over a cached prefix."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'kvstrata[gpu]')")
    pytest.importorskip("transformers")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT, str(Path(__file__).parent)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok" in out.stdout


# -- CUDA ----------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda") if torch.cuda.is_available() else CPU


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 32)]
)
def test_kernel_matches_sdpa_on_cuda(dtype: torch.dtype, head_dim: int) -> None:
    """Compiled kernel, two launch shapes (the dtype's default and a small one), random batches
    with long prefixes: output within the dtype's tolerance of SDPA (gathered), every row
    written, LSE equal to float64's."""
    import math

    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    for seed in range(3):
        batch, q, k, v, kp, vp = random_case(
            seed, CUDA, dtype, heads=8, kv_heads=2, head_dim=head_dim, max_len=400
        )
        expected = PagedAttention("sdpa")(q, k, v, kp, vp, batch).float()
        for kernel in [None, KERNELS[1]]:
            lse = torch.full(q.shape[:2], float("nan"), device=CUDA)
            attention = PagedAttention("triton", kernel)
            got = attention(q, k, v, kp, vp, batch, lse=lse).float()  # the kernel on every row
            mixed = attention(q, k, v, kp, vp, batch).float()  # fresh requests: flash
            for out in (got, mixed):
                assert torch.isfinite(out).all()
                err = float((out - expected).norm() / expected.norm())
                assert err < tol, (seed, kernel, err)
            ref = reference_lse(batch, q, kp, 1 / math.sqrt(head_dim))
            assert torch.allclose(lse.double(), ref, atol=1e-3 if dtype == torch.float32 else 0.05)


@pytest.mark.gpu
@gpu
def test_engine_on_cuda_with_the_kernel_equals_uncached_recompute() -> None:
    """fp32 on CUDA: chunked prefills over cached prefixes (L1 and L2 hits) give the logits of a
    no-cache recompute; the kernel, not SDPA, ran (the model's backend resolves to triton)."""
    from kvstrata.engine import Engine, EngineConfig
    from kvstrata.model.compute import ModelCompute
    from kvstrata.model.loader import load_model
    from kvstrata.replay import recompute_uncached
    from kvstrata.workloads import builtin

    _, model = load_model("tiny", device="cuda", dtype="float32", seed=0)
    assert PagedAttention.for_device("auto", CUDA, model.config.head_dim).backend == "triton"
    compute = ModelCompute(model, torch.float32)
    config = EngineConfig(
        page_size=16, pool_tokens=1024, chunk_size=64, max_batch_tokens=256, device="cuda",
        l2_tokens=8192,
    )  # fmt: skip
    engine = Engine(compute, config)
    requests = builtin(compute.vocab_size, seed=3, n_requests=40)
    engine.keep_logits = {r.rid for r in requests}
    for r in requests:
        engine.add(r)
    out = {}
    while engine.has_work():
        out.update({f.rid: f for f in engine.step()})
    hits = [r for r in requests if out[r.rid].cached_len > 0]
    assert len(hits) >= 10 and any(out[r.rid].host_len for r in requests)
    for r in hits:
        fresh = recompute_uncached(compute, config, r)
        got = out[r.rid].logits
        assert got is not None
        assert float((fresh - got).abs().max()) <= 1e-4, r.rid


@pytest.mark.gpu
@gpu
def test_batch_metadata_reaches_the_device_in_one_copy() -> None:
    """The packed ids, tables and lengths are one pinned host-to-device copy; building the batch
    and running the indices never reads a device value back (no synchronising call)."""
    tables = [np.arange(4), np.arange(4, 10)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        batch = ForwardBatch.build([10, 0], [20, 90], tables, 16, CUDA, input_ids=np.arange(110))
        torch.cuda.synchronize()
    copies = [e for e in prof.events() if "HtoD" in e.name]
    assert len(copies) == 1, [e.name for e in prof.events()]
    assert batch.input_ids is not None and batch.input_ids.tolist() == list(range(110))


@pytest.mark.gpu
@gpu
def test_forward_never_syncs_the_host_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA's sync debug mode set to error, building a batch and running every layer of a
    forward over a cached prefix raises on any synchronising call (.item(), .tolist(), a
    blocking copy). Only the input check, which reads the token ids once per forward, is left
    out."""
    from kvstrata.model.loader import load_model
    from kvstrata.tiers.pool import DevicePool

    _, model = load_model("tiny", device="cuda", dtype="bfloat16", seed=0)
    pool = DevicePool(model.config.kv_layout("bfloat16"), 16, 64, "cuda")
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 300)
    table = np.random.default_rng(1).permutation(64)[:19]
    first = ForwardBatch.build([0], [200], [table], 16, CUDA, input_ids=ids[:200])
    assert first.input_ids is not None
    model(first.input_ids, first, pool)
    monkeypatch.setattr(model, "_check_inputs", lambda *args: None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = ForwardBatch.build([200], [100], [table], 16, CUDA, input_ids=ids[200:])
        assert batch.input_ids is not None
        logits = model(batch.input_ids, batch, pool)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(logits.float()).all()


@pytest.mark.gpu
@gpu
def test_fresh_requests_on_cuda_never_take_cudnn_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN's SDPA builds a graph per new sequence length (~40 ms each on an H200), so a
    replay's fresh requests, each of its own length, must reach flash (bf16) or math (fp32 with
    GQA) instead: every SDPA call from sdpa_causal on CUDA runs with cuDNN's backend off, and
    the result still equals the CPU's."""
    from kvstrata.model import attention

    seen: list[bool] = []
    real = attention._sdpa

    # Spied where sdpa_causal calls torch (under its backend choice), not by replacing
    # F.scaled_dot_product_attention: torch's CausalBias dispatch compares against that very
    # function, and a stand-in sends the lower-right mask down a path that breaks GQA.
    def spy(q: torch.Tensor, *args: Any) -> torch.Tensor:
        if q.is_cuda:
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(q, *args)

    monkeypatch.setattr(attention, "_sdpa", spy)
    for dtype in (torch.bfloat16, torch.float32):
        for length in (13, 22, 353):
            q = torch.randn(length, 8, 64, device=CUDA, dtype=dtype)
            k, v = torch.randn(2, length + 5, 2, 64, device=CUDA, dtype=dtype)
            for keys in (length, length + 5):  # fresh, and over a 5-token prefix
                got = attention.sdpa_causal(q, k[:keys], v[:keys])
                want = attention.sdpa_causal(*(t.cpu().float() for t in (q, k[:keys], v[:keys])))
                tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
                assert torch.allclose(got.float().cpu(), want, atol=tol, rtol=tol)
    assert len(seen) == 12 and not any(seen), seen
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the caller's setting is left as it was
