"""``kvstrata check-model``: trust a checkpoint before serving it.

Loads the same weights with kvstrata and with transformers and compares all-token logits over a few
prompts whose lengths are not multiples of the page size (and one that spans several pages and
reads a cached prefix back from the pool). A preset is first written out as a Hugging Face
checkpoint, so the loader is exercised too. A NaN or inf logit on either side is a failure, never a
difference of 0, and the weights holding non-finite values are named.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConfigError, ModelError
from .limits import check_device, check_fits
from .model.batch import ForwardBatch
from .model.config import PRESETS, DecoderConfig
from .model.decoder import Decoder
from .model.loader import load_model, read_model_config, resolve_dtype, weight_bytes
from .ownership import page_span
from .tiers.pool import DevicePool

#: Prompt lengths that straddle page boundaries for page sizes 16 and 64.
DEFAULT_LENGTHS = (1, 7, 37, 100, 129)


#: Weights with non-finite values a report names (the count is complete).
NAMED_WEIGHTS = 5


@dataclass(frozen=True)
class CheckReport:
    """The comparison's outcome. ``max_abs_logit_diff`` is over positions finite on both sides;
    any non-finite logit (``nonfinite_ours``, ``nonfinite_theirs``) fails the check."""

    model: str
    architecture: str
    lengths: tuple[int, ...]
    max_abs_logit_diff: float
    argmax_agree: float  # fraction of compared token positions whose argmax matches
    atol: float
    nonfinite_ours: int = 0  # NaN/inf logit values from kvstrata
    nonfinite_theirs: int = 0  # ... from transformers
    nonfinite_weights: int = 0  # weights (tensors) holding a NaN or inf
    nonfinite_weight_names: tuple[str, ...] = ()  # the first NAMED_WEIGHTS of them

    @property
    def ok(self) -> bool:
        return (
            self.nonfinite_ours == 0
            and self.nonfinite_theirs == 0
            and self.nonfinite_weights == 0
            and self.max_abs_logit_diff <= self.atol
            and self.argmax_agree == 1.0
        )


def _our_logits(model: Decoder, tokens: torch.Tensor, page_size: int, split: int) -> torch.Tensor:
    """All-token logits, computed as two forwards: ``[0, split)`` then the rest reading it back."""
    config = model.config
    dtype = next(model.parameters()).dtype
    n = tokens.numel()
    pages = page_span(n, page_size)
    pool = DevicePool(
        config.kv_layout(str(dtype).removeprefix("torch.")), page_size, pages, tokens.device
    )
    table = torch.arange(pages - 1, -1, -1)  # reversed slots: a wrong page table cannot pass
    parts = [(0, split), (split, n)] if 0 < split < n else [(0, n)]
    out = []
    for lo, hi in parts:
        batch = ForwardBatch.build([lo], [hi - lo], [table], page_size, tokens.device)
        out.append(model(tokens[lo:hi], batch, pool, logits="all"))
    return torch.cat(out).float()


def check_model(
    path_or_preset: str,
    *,
    device: str = "cpu",
    dtype: str | None = None,
    lengths: tuple[int, ...] = DEFAULT_LENGTHS,
    page_size: int = 16,
    atol: float | None = None,
    seed: int = 0,
) -> CheckReport:
    """Compare kvstrata's logits with transformers' on the same weights.

    Every argument is checked (and the model's config read) before any weight is loaded.
    """
    try:
        import transformers  # noqa: F401 (checked here, used by _compare)
    except ImportError:
        raise ModelError("check-model needs transformers: pip install 'kvstrata[hf]'") from None
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"prompt lengths must be >= 1, got {lengths}")
    if page_size < 1:
        raise ConfigError(f"--page-size must be >= 1, got {page_size}")
    if atol is not None and not (math.isfinite(atol) and atol >= 0):
        raise ConfigError(f"--atol must be a finite number >= 0, got {atol}")
    torch_device = check_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    config = read_model_config(path_or_preset)
    if max(lengths) <= 2 * page_size:
        # At least one prompt must span a cached prefix of whole pages read back from the pool.
        lengths = (*lengths, 2 * page_size + 3)
    if max(lengths) > config.max_position_embeddings:
        raise ConfigError(
            f"a {max(lengths):,}-token prompt (two pages of --page-size {page_size} and a few "
            f"tokens) exceeds the model's {config.max_position_embeddings:,} positions; use a "
            "smaller --page-size"
        )
    copy = weight_bytes(config, torch_dtype)
    n = max(lengths)
    check_fits(
        [
            ("kvstrata's copy of the weights", copy),
            ("transformers' copy", copy),
            # Upper bounds for the longest prompt: an attention that materialises its scores,
            # and both sides' fp32 logits for every token.
            (f"attention scores of {n:,} tokens", n * n * config.num_heads * 4),
            ("all-token logits", 2 * n * config.vocab_size * 4),
        ],
        torch_device,
        hint="use a smaller --page-size, or a device with more memory",
    )
    return _compare(
        path_or_preset, torch_device, torch_dtype, tuple(lengths), page_size, atol, seed
    )


def _compare(
    path_or_preset: str,
    device: torch.device,
    dtype: torch.dtype,
    lengths: tuple[int, ...],
    page_size: int,
    atol: float | None,
    seed: int,
) -> CheckReport:
    import transformers

    # Its loading and saving bars are noise next to the report (and a stream of carriage
    # returns in a log file).
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(path_or_preset)
        if path_or_preset in PRESETS and not path.exists():
            path = Path(tmp) / "checkpoint"
            _write_preset_checkpoint(PRESETS[path_or_preset], path, seed)
        config, ours = load_model(path, device=device, dtype=dtype)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, attn_implementation="sdpa"
        )
        # Module.to moves in place; transformers' decorator on it confuses mypy.
        theirs.to(device)  # type: ignore[arg-type]
        theirs.eval()
        gen = torch.Generator().manual_seed(seed)
        max_diff, agree, total, bad_ours, bad_theirs = 0.0, 0, 0, 0, 0
        for n in lengths:
            tokens = torch.randint(0, config.vocab_size, (n,), generator=gen).to(device)
            with torch.inference_mode():
                ref = theirs(tokens[None]).logits[0].float()
            mine = _our_logits(ours, tokens, page_size, split=n // 2 // page_size * page_size)
            finite_mine, finite_ref = torch.isfinite(mine), torch.isfinite(ref)
            bad_ours += int((~finite_mine).sum())
            bad_theirs += int((~finite_ref).sum())
            both = finite_mine & finite_ref
            diff = (mine - ref).abs()[both]  # NaN never counts as agreement: max() would drop it
            if diff.numel():
                max_diff = max(max_diff, float(diff.max()))
            rows_finite = both.all(-1)
            agree += int(((mine.argmax(-1) == ref.argmax(-1)) & rows_finite).sum())
            total += n
    bad_weights = [  # by their checkpoint names (ours drop transformers' "model." prefix)
        name if name.startswith("lm_head.") else f"model.{name}"
        for name, w in ours.state_dict().items()
        if not bool(torch.isfinite(w).all())
    ]
    if atol is None:
        atol = 1e-3 if dtype == torch.float32 else 0.5
    return CheckReport(
        model=str(path_or_preset),
        architecture=config.architecture,
        lengths=lengths,
        max_abs_logit_diff=max_diff,
        argmax_agree=agree / total,
        atol=atol,
        nonfinite_ours=bad_ours,
        nonfinite_theirs=bad_theirs,
        nonfinite_weights=len(bad_weights),
        nonfinite_weight_names=tuple(bad_weights[:NAMED_WEIGHTS]),
    )


def _write_preset_checkpoint(config: DecoderConfig, path: Path, seed: int) -> None:
    """Save a randomly initialised transformers model of ``config`` as a checkpoint."""
    import transformers

    fields = config.to_hf()
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    model.save_pretrained(path, safe_serialization=True)
