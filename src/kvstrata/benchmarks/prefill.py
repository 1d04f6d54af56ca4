"""Prefill throughput of kvstrata's model against transformers, on the same weights and inputs.

Both sides compute what an uncached prefill needs: every layer's KV (ours into the paged pool,
transformers into its cache; for an MLA preset, the latent) and the logits of the last token only.
The transformers model uses ``attn_implementation="sdpa"`` and ``logits_to_keep=1``. Output: a
table, then one JSON object on the last line.

    kvstrata bench prefill --device cpu        # preset small, float32, 1024 tokens
    kvstrata bench prefill --preset llama-3.2-1b --device cuda --lengths 1024 8192 32768
    kvstrata bench prefill --preset deepseek-v2-lite --device cuda --lengths 8192
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ..command import CommandParser, run_command
from ..errors import ConfigError, ModelError
from ..limits import check_device, check_fits
from ..model import PRESETS, ForwardBatch, convert_hf_state
from ..model.attention import ATTENTION_BACKENDS
from ..model.config import DecoderConfig
from ..model.decoder import Decoder
from ..model.loader import build_model, weight_bytes
from ..ownership import page_span
from ..tiers.pool import DevicePool

PROG = "kvstrata bench prefill"
#: More timed or warm-up runs than this is a typo, not a measurement (the median settles long before).
_MAX_RUNS = 10_000


@dataclass(frozen=True, slots=True)
class Result:
    """Median prefill throughput of both implementations at one prompt length."""

    length: int
    ours_tok_s: float
    transformers_tok_s: float

    @property
    def ratio(self) -> float:
        return self.ours_tok_s / self.transformers_tok_s


def build_models(
    config: DecoderConfig, device: torch.device, dtype: torch.dtype, seed: int
) -> tuple[Decoder, torch.nn.Module]:
    """A transformers model with seeded random weights, and ours holding the same weights."""
    import transformers

    hf_dict = config.to_hf()
    hf_config = transformers.AutoConfig.for_model(
        hf_dict.pop("model_type"), **{k: v for k, v in hf_dict.items() if k != "architectures"}
    )
    torch.manual_seed(seed)
    with torch.device(device):
        hf_model = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation="sdpa", dtype=dtype
        )
    hf_model.eval().requires_grad_(False)
    if "logits_to_keep" not in inspect.signature(hf_model.forward).parameters:
        raise ModelError(
            f"transformers {transformers.__version__} has no logits_to_keep; "
            "this benchmark needs transformers >= 4.50"
        )
    state = {name: t.detach() for name, t in hf_model.state_dict().items()}
    ours = build_model(config, convert_hf_state(config, state))
    return ours, hf_model


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call of ``fn``, with the device drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def median_seconds(
    fns: Sequence[Callable[[], object]], device: torch.device, warmup: int, repeats: int
) -> list[float]:
    """Median wall time of each of ``fns`` over ``repeats`` runs, after ``warmup`` untimed runs.

    The functions take turns within every repeat, so a change in machine load (a shared CPU)
    affects all of them alike instead of whichever happened to run during it.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_times in zip(fns, times, strict=True):
            fn_times.append(timed(fn, device))
    return [statistics.median(t) for t in times]


def run(args: argparse.Namespace) -> list[Result]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    config = PRESETS[args.preset]
    ours, hf_model = build_models(config, device, dtype, args.seed)
    ours.use_attention(args.attention)
    ours.paged_attention(device)  # refuse a backend the device cannot run before timing
    page_size = args.page_size
    max_pages = page_span(max(args.lengths), page_size)
    pool = DevicePool(
        config.kv_layout(args.dtype), page_size=page_size, num_slots=max_pages, device=device
    )
    generator = torch.Generator().manual_seed(args.seed)
    results = []
    for length in args.lengths:
        input_ids = torch.randint(0, config.vocab_size, (length,), generator=generator).to(device)
        page_table = torch.arange(page_span(length, page_size))

        def ours_prefill(
            input_ids: torch.Tensor = input_ids,
            length: int = length,
            page_table: torch.Tensor = page_table,
        ) -> object:
            # The batch metadata is part of a prefill's cost, as transformers' masks are of its.
            batch = ForwardBatch.build([0], [length], [page_table], page_size, device)
            return ours(input_ids, batch, pool, logits="last")

        def hf_prefill(input_ids: torch.Tensor = input_ids) -> object:
            return hf_model(input_ids[None], logits_to_keep=1, use_cache=True).logits

        with torch.inference_mode():
            ours_s, hf_s = median_seconds(
                [ours_prefill, hf_prefill], device, args.warmup, args.repeats
            )
        results.append(Result(length, length / ours_s, length / hf_s))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


#: Per device type: preset, dtype and prompt lengths when the command line names none. "small" on CPU
#: because "tiny" is so small that per-op overhead, not the model's arithmetic, sets its speed.
_DEFAULTS = {
    "cpu": ("small", "float32", [1024]),
    "cuda": ("llama-3.2-1b", "bfloat16", [1024, 8192, 32768]),
}


def build_parser() -> CommandParser:
    """The benchmark's flags."""
    parser = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), help="default: small on CPU, llama-3.2-1b on CUDA"
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="default: float32 on CPU, bfloat16 on CUDA",
    )
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        help="prompt lengths; default: 1024 on CPU, 1024 8192 32768 on CUDA",
    )
    parser.add_argument(
        "--attention",
        choices=list(ATTENTION_BACKENDS),
        default="auto",
        help="our attention backend (auto: triton on CUDA, sdpa on the CPU)",
    )
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7, help="timed runs; the median is reported")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before timing")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Fill in the per-device defaults and refuse values the benchmark cannot run with, before
    any model is built."""
    if importlib.util.find_spec("transformers") is None:
        raise ModelError("bench prefill needs transformers: pip install 'kvstrata[hf]'")
    device = check_device(args.device)
    preset, dtype, lengths = _DEFAULTS[device.type]
    args.preset = args.preset or preset
    args.dtype = args.dtype or dtype
    args.lengths = args.lengths or lengths
    config = PRESETS[args.preset]
    if not 1 <= min(args.lengths) <= max(args.lengths) <= config.max_position_embeddings:
        raise ConfigError(
            f"--lengths must lie in [1, {config.max_position_embeddings:,}] (the positions of "
            f"{args.preset}), got {args.lengths}"
        )
    if args.page_size < 1:
        raise ConfigError(f"--page-size must be >= 1, got {args.page_size}")
    if not 1 <= args.repeats <= _MAX_RUNS or not 0 <= args.warmup <= _MAX_RUNS:
        raise ConfigError(
            f"--repeats must lie in [1, {_MAX_RUNS:,}] and --warmup in [0, {_MAX_RUNS:,}], got "
            f"{args.repeats} and {args.warmup}"
        )
    if not 0 <= args.seed < 2**64:
        raise ConfigError(f"--seed must lie in [0, 2**64), got {args.seed}")
    copy = weight_bytes(config, getattr(torch, args.dtype))
    pool = page_span(max(args.lengths), args.page_size) * config.kv_layout(args.dtype).page_bytes(
        args.page_size
    )
    check_fits(
        [("two copies of the weights", 2 * copy), ("the pool", pool)],
        device,
        hint="use a smaller --preset or shorter --lengths",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark for command-line arguments ``argv``; returns the exit status."""
    args = build_parser().parse_args(argv)
    check_args(args)
    import transformers

    results = run(args)
    print(f"preset {args.preset}, {args.device}, {args.dtype}, median of {args.repeats}")
    print(f"{'length':>8} {'ours tok/s':>14} {'transformers tok/s':>20} {'ratio':>7}")
    for r in results:
        print(
            f"{r.length:>8} {r.ours_tok_s:>14,.0f} {r.transformers_tok_s:>20,.0f} {r.ratio:>7.3f}"
        )
    summary = {
        "bench": "prefill",
        "preset": args.preset,
        "device": args.device,
        "dtype": args.dtype,
        "attention": args.attention,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "repeats": args.repeats,
        "results": [asdict(r) | {"ratio": r.ratio} for r in results],
        "min_ratio": min((r.ratio for r in results), default=None),
    }
    print(json.dumps(summary))
    return 0


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes (``kvstrata bench prefill``)."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
