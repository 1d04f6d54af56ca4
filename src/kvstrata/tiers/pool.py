"""The device pool (L1): storage for every payload and layer, indexed by rank-local slot.

One tensor per (payload, layer), shaped ``[num_slots, page_size, *token_shape]`` on a chosen
torch device. A slot holds one page: ``page_size`` tokens of that payload in that layer. Which
logical page a slot holds is decided by the allocator (``slot = logical_page // cp_size``); the pool
only stores bytes.
"""

from __future__ import annotations

import torch

from ..config import KVLayout
from ..errors import CapacityError, ConfigError

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a payload dtype name."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use one of {sorted(_TORCH_DTYPES)}") from None


class DevicePool:
    """Per-payload, per-layer page storage of one rank on one torch device."""

    def __init__(
        self,
        layout: KVLayout,
        page_size: int,
        num_slots: int,
        device: str | torch.device = "cpu",
    ) -> None:
        if page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 1:
            raise ConfigError(
                f"a device pool needs at least one slot, got {num_slots}; raise the pool size"
            )
        self.layout = layout
        self.page_size = page_size
        self.num_slots = num_slots
        self.device = torch.device(device)
        try:
            self._buffers: dict[str, list[torch.Tensor]] = {
                spec.name: [
                    torch.zeros(
                        (num_slots, page_size, *spec.token_shape),
                        dtype=torch_dtype(spec.dtype),
                        device=self.device,
                    )
                    for _ in range(layout.layers(spec))
                ]
                for spec in layout.payloads
            }
        except RuntimeError as err:  # torch.OutOfMemoryError included
            gib = layout.page_bytes(page_size) * num_slots / 2**30
            raise CapacityError(
                f"cannot allocate a {gib:.1f} GiB device pool ({num_slots} pages) on "
                f"{self.device}: {str(err).splitlines()[0]}; use a smaller pool (--l1-tokens)"
            ) from None

    def buffer(self, payload: str, layer: int) -> torch.Tensor:
        """The ``[num_slots, page_size, *token_shape]`` tensor of ``payload`` in ``layer``."""
        layers = self._buffers.get(payload)
        if layers is None:
            raise ConfigError(
                f"no payload {payload!r} in this pool; it has {sorted(self._buffers)}"
            )
        if not 0 <= layer < len(layers):
            raise ConfigError(f"layer {layer} is outside [0, {len(layers)}) for this pool")
        return layers[layer]

    def token_view(self, payload: str, layer: int) -> torch.Tensor:
        """The same storage viewed as ``[num_slots * page_size, *token_shape]`` (token rows)."""
        buf = self.buffer(payload, layer)
        return buf.view(self.num_slots * self.page_size, *buf.shape[2:])

    @property
    def page_bytes(self) -> int:
        """Bytes of one slot across all payloads and layers."""
        return self.layout.page_bytes(self.page_size)

    @property
    def total_bytes(self) -> int:
        return self.page_bytes * self.num_slots
