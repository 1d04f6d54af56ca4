"""Paged attention kernels on the same pages (``kvstrata bench attention``, CUDA only).

Llama-3.2-1B attention shapes (32 query heads, 8 KV heads, head size 64, bf16, page 16), pages at
shuffled slots. Each case is one layer's attention of a packed batch, as the model runs it:

* ``kernel ...``: :mod:`kvstrata.model.attention_kernel` alone, on every request, reading every
  key from its page in place (``--sweep``: one row per launch shape);
* ``triton (backend)``: what the model runs with ``--attention triton``: the kernel for requests
  with a cached prefix, flash on the fresh ones' contiguous K/V;
* ``sdpa``: per request, torch SDPA (flash), gathering a request's sequence out of the pages first
  when it has a cached prefix (the path the engine had before the kernel);
* ``flash``: the same SDPA call on K/V already contiguous (no gather): the flash kernel's own speed,
  which no paged kernel beats by reading pages;
* ``flex`` (``--flex``, two single-request cases): FlexAttention, compiled, over contiguous K/V
  with a causal block mask: its best case, since its block mask addresses 128-key tiles and a tile
  of page-16 pages at scattered slots would need a gather first.

Before timing, each variant's output is compared with ``sdpa``'s. Times are CUDA-event medians
(``triton.testing.do_bench``); TFLOP/s count the causal work, 4 x D flops per (query, visible key,
head). ``--sweep`` times a grid of kernel launch shapes and reports the best per case. Output: a
table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ..command import CommandParser, HelpFormatter, run_command
from ..errors import ConfigError
from ..limits import check_device
from ..model.attention import PagedAttention, sdpa_causal
from ..model.attention_kernel import AttentionKernelConfig, paged_prefill
from ..model.batch import ForwardBatch

PROG = "kvstrata bench attention"
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 64, 16
#: (name, [(prefix, extend), ...]): one layer's packed batch.
CASES: list[tuple[str, list[tuple[int, int]]]] = [
    ("fresh 8K", [(0, 8192)]),
    ("fresh 16K", [(0, 16384)]),
    ("32K prefix + 1K", [(32768, 1024)]),
    ("88K prefix + 8K", [(90112, 8192)]),
    ("mixed 8 x 2K", [(p, 2048) for p in (0, 0, 2048, 4096, 8192, 0, 16384, 30720)]),
]
FLEX_CASES = ("fresh 8K", "32K prefix + 1K")
SWEEP = [
    AttentionKernelConfig(m, n, w, s, pack)
    for m, n, w, s, pack in [
        (128, 64, 4, 3, True),
        (128, 64, 8, 3, True),
        (128, 128, 8, 3, True),
        (128, 64, 4, 2, True),
        (128, 64, 4, 4, True),
        (128, 32, 4, 3, True),
        (64, 64, 4, 3, True),
        (64, 32, 4, 3, True),
        (256, 64, 8, 3, True),
        (128, 128, 4, 2, True),
        (128, 64, 4, 3, False),
        (128, 64, 8, 3, False),
        (128, 128, 4, 3, True),
        (128, 128, 4, 2, False),
    ]
]


@dataclass
class Row:
    case: str
    variant: str
    ms: float
    tflops: float
    max_abs_diff: float | None


def causal_flops(requests: list[tuple[int, int]]) -> float:
    """4 x D x heads flops per (query, visible key) pair."""
    pairs = sum(e * p + e * (e + 1) / 2 for p, e in requests)
    return 4.0 * HEAD_DIM * HEADS * pairs


class Case:
    """Pages at shuffled slots holding every request's sequence, and one layer's extend tokens."""

    def __init__(self, requests: list[tuple[int, int]], device: torch.device, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        seq_pages = [-(-(p + e) // PAGE) for p, e in requests]
        slots = torch.randperm(sum(seq_pages) + 8, generator=gen)
        tables, used = [], 0
        for n in seq_pages:
            tables.append(slots[used : used + n])
            used += n
        self.requests = requests
        self.batch = ForwardBatch.build(
            [p for p, _ in requests], [e for _, e in requests], tables, PAGE, device
        )
        T = self.batch.num_tokens
        shape = (slots.numel(), PAGE, KV_HEADS, HEAD_DIM)
        bf16 = torch.bfloat16
        self.k_pages = torch.randn(shape, device=device, dtype=bf16)
        self.v_pages = torch.randn(shape, device=device, dtype=bf16)
        self.q = torch.randn(T, HEADS, HEAD_DIM, device=device, dtype=bf16)
        self.k = self.k_pages.view(-1, KV_HEADS, HEAD_DIM)[self.batch.write_index]
        self.v = self.v_pages.view(-1, KV_HEADS, HEAD_DIM)[self.batch.write_index]
        rows = self.batch.read_index  # contiguous copies, for the no-gather references
        self.k_seq = [self.k_pages.view(-1, KV_HEADS, HEAD_DIM)[r] for r in rows]
        self.v_seq = [self.v_pages.view(-1, KV_HEADS, HEAD_DIM)[r] for r in rows]
        self.all_requests = torch.arange(len(requests), device=device)

    def run(self, attention: PagedAttention) -> torch.Tensor:
        return attention(self.q, self.k, self.v, self.k_pages, self.v_pages, self.batch)

    def kernel(self, config: AttentionKernelConfig) -> torch.Tensor:
        """The paged kernel alone, on every request (the backend sends fresh ones to flash)."""
        out = torch.empty_like(self.q)
        b = self.batch
        assert b.page_table is not None and b.table_starts is not None
        assert b.prefix_lens_device is not None
        paged_prefill(
            self.q, self.k_pages, self.v_pages, out, self.all_requests, b.cu_seqlens,
            b.prefix_lens_device, b.page_table, b.table_starts, max(b.extend_lens), config,
        )  # fmt: skip
        return out

    def flash(self) -> torch.Tensor:
        out = torch.empty_like(self.q)
        cu = self.batch.cu_seqlens_host
        for i in range(len(self.requests)):
            out[cu[i] : cu[i + 1]] = sdpa_causal(
                self.q[cu[i] : cu[i + 1]], self.k_seq[i], self.v_seq[i]
            )
        return out


def _flex(case: Case) -> Callable[[], torch.Tensor]:
    """FlexAttention (compiled) over each request's contiguous K/V with a causal block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    cu = case.batch.cu_seqlens_host
    calls = []
    for i, (prefix, extend) in enumerate(case.requests):
        q = case.q[cu[i] : cu[i + 1]].transpose(0, 1)[None]
        k = case.k_seq[i].transpose(0, 1)[None]
        v = case.v_seq[i].transpose(0, 1)[None]

        def causal(b, h, qi, ki, prefix=prefix):  # type: ignore[no-untyped-def]
            return ki <= qi + prefix

        mask = create_block_mask(causal, 1, 1, extend, prefix + extend, device=q.device)
        calls.append((q, k, v, mask))

    def run() -> torch.Tensor:
        outs = [compiled(q, k, v, block_mask=m, enable_gqa=True) for q, k, v, m in calls]
        return torch.cat([o[0].transpose(0, 1) for o in outs])

    return run


def _runner(case: Case, attention: PagedAttention) -> Callable[[], torch.Tensor]:
    return lambda: case.run(attention)


def _kernel_runner(case: Case, config: AttentionKernelConfig) -> Callable[[], torch.Tensor]:
    return lambda: case.kernel(config)


def bench(args: argparse.Namespace) -> list[Row]:
    from triton.testing import do_bench

    if not 1 <= args.warmup_ms <= 60_000 or not 1 <= args.rep_ms <= 600_000:
        raise ConfigError(
            f"--warmup-ms must lie in [1, 60000] and --rep-ms in [1, 600000], got "
            f"{args.warmup_ms} and {args.rep_ms}"
        )
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed must lie in [0, 2**63), got {args.seed}")
    device = check_device(args.device)
    if device.type != "cuda":
        raise ConfigError(f"{PROG} times CUDA kernels; run it with --device cuda (got {device})")
    rows: list[Row] = []
    kernels = SWEEP if args.sweep else [AttentionKernelConfig()]  # the default is in SWEEP
    for name, requests in CASES:
        case = Case(requests, device, args.seed)
        flops = causal_flops(requests)
        reference = case.run(PagedAttention("sdpa"))
        variants: list[tuple[str, Callable[[], torch.Tensor]]] = [
            ("sdpa", _runner(case, PagedAttention("sdpa"))),
            ("flash", case.flash),
            ("triton (backend)", _runner(case, PagedAttention("triton"))),
        ]
        for kernel in kernels:
            label = (
                f"kernel m{kernel.block_m} n{kernel.block_n} w{kernel.num_warps} "
                f"s{kernel.num_stages}{' pack' if kernel.pack_gqa else ''}"
            )
            variants.append((label, _kernel_runner(case, kernel)))
        if args.flex and name in FLEX_CASES:  # one compile per shape: two cases only
            variants.append(("flex", _flex(case)))
        for label, fn in variants:
            out = fn()
            diff = float((out.float() - reference.float()).abs().max())
            ms = do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
            rows.append(Row(name, label, ms, flops / ms / 1e9, diff))
        del case
        torch.cuda.empty_cache()
    return rows


def build_parser() -> CommandParser:
    parser = CommandParser(
        prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sweep", action="store_true", help="time a grid of kernel launch shapes")
    parser.add_argument("--flex", action="store_true", help="also time FlexAttention (compiles)")
    parser.add_argument("--warmup-ms", type=int, default=50, help="do_bench warm-up, ms")
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench timing budget, ms")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = bench(args)
    print(f"{'case':<18} {'variant':<32} {'ms':>9} {'TFLOP/s':>8} {'max|diff|':>10}")
    for r in rows:
        diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.2e}"
        print(f"{r.case:<18} {r.variant:<32} {r.ms:>9.3f} {r.tflops:>8.1f} {diff:>10}")
    best: dict[str, Row] = {}
    for r in rows:
        if r.variant.startswith("kernel") and (r.case not in best or r.ms < best[r.case].ms):
            best[r.case] = r
    print(
        json.dumps(
            {
                "bench": "attention",
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "rows": [asdict(r) for r in rows],
                "best_kernel": {c: {"variant": r.variant, "ms": r.ms} for c, r in best.items()},
            }
        )
    )
    return 0


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes (``kvstrata bench attention``)."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
