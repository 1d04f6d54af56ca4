"""``kvstrata check-model``: trust a checkpoint before serving it.

Loads the same weights with kvstrata and with transformers and compares all-token logits over a few
prompts whose lengths are not multiples of the page size (and one that spans several pages and
reads a cached prefix back from the pool). A preset is first written out as a Hugging Face
checkpoint, so the loader is exercised too.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConfigError, ModelError
from .model.batch import ForwardBatch
from .model.config import PRESETS, ModelConfig
from .model.llama import LlamaModel
from .model.loader import load_model
from .ownership import page_span
from .pool import DevicePool

#: Prompt lengths that straddle page boundaries for page sizes 16 and 64.
DEFAULT_LENGTHS = (1, 7, 37, 100, 129)


@dataclass(frozen=True)
class CheckReport:
    model: str
    architecture: str
    lengths: tuple[int, ...]
    max_abs_logit_diff: float
    argmax_agree: float  # fraction of compared token positions whose argmax matches
    atol: float

    @property
    def ok(self) -> bool:
        return self.max_abs_logit_diff <= self.atol and self.argmax_agree == 1.0


def _our_logits(
    model: LlamaModel, tokens: torch.Tensor, page_size: int, split: int
) -> torch.Tensor:
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
    """Compare kvstrata's logits with transformers' on the same weights."""
    try:
        import transformers
    except ImportError:
        raise ModelError("check-model needs transformers: pip install 'kvstrata[hf]'") from None
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"prompt lengths must be >= 1, got {lengths}")
    if page_size < 1:
        raise ConfigError(f"--page-size must be >= 1, got {page_size}")
    if atol is not None and not (math.isfinite(atol) and atol >= 0):
        raise ConfigError(f"--atol must be a finite number >= 0, got {atol}")
    if max(lengths) <= 2 * page_size:
        # At least one prompt must span a cached prefix of whole pages read back from the pool.
        lengths = (*lengths, 2 * page_size + 3)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(path_or_preset)
        if not path.exists():
            if path_or_preset not in PRESETS:
                raise ConfigError(
                    f"{path_or_preset!r} is neither a checkpoint directory nor a preset "
                    f"({', '.join(PRESETS)})"
                )
            path = Path(tmp) / "checkpoint"
            _write_preset_checkpoint(PRESETS[path_or_preset], path, seed)
        config, ours = load_model(path, device=device, dtype=dtype)
        torch_dtype = next(ours.parameters()).dtype
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype, attn_implementation="sdpa"
        )
        # Module.to moves in place; transformers' decorator on it confuses mypy.
        theirs.to(device)  # type: ignore[arg-type]
        theirs.eval()
        gen = torch.Generator().manual_seed(seed)
        max_diff, agree, total = 0.0, 0, 0
        for n in lengths:
            tokens = torch.randint(0, config.vocab_size, (n,), generator=gen).to(device)
            with torch.inference_mode():
                ref = theirs(tokens[None]).logits[0].float()
            mine = _our_logits(ours, tokens, page_size, split=n // 2 // page_size * page_size)
            max_diff = max(max_diff, float((mine - ref).abs().max()))
            agree += int((mine.argmax(-1) == ref.argmax(-1)).sum())
            total += n
    if atol is None:
        atol = 1e-3 if torch_dtype == torch.float32 else 0.5
    return CheckReport(
        model=str(path_or_preset),
        architecture=config.architecture,
        lengths=tuple(lengths),
        max_abs_logit_diff=max_diff,
        argmax_agree=agree / total,
        atol=atol,
    )


def _write_preset_checkpoint(config: ModelConfig, path: Path, seed: int) -> None:
    """Save a randomly initialised transformers model of ``config`` as a checkpoint."""
    import transformers

    fields = config.to_hf()
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    model.save_pretrained(path, safe_serialization=True)
