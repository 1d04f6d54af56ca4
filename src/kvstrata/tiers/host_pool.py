"""The host pool (L2): page storage of one rank in CPU memory, pinned when CUDA is available.

Like :class:`~kvstrata.tiers.pool.DevicePool` it only stores bytes; which logical page a host slot holds
is decided by the L2 allocator. Two layouts of the same bytes:

``layer_first``  per (payload, layer) a tensor ``[slots, page_size, *token_shape]``, as on the
                 device: one layer's pages are one array, so a layer's copy reads one tensor.
``page_first``   per payload a tensor ``[slots, num_layers, page_size, *token_shape]``: all layers
                 of one page are contiguous, so a page is one extent (one disk write per page).

Storage is split into *slabs* so that no single allocation exceeds ``max_alloc_bytes`` (pinning or
allocating hundreds of GiB in one piece fails or stalls on some machines). Every slab is a separate
tensor, and host slots map to slabs by a fixed division, the same for every payload and layer::

    host slot   0 1 2 | 3 4 5 | 6 7          slots_per_slab = 3, num_slots = 8
    slab        0     | 1     | 2
    row         0 1 2 | 0 1 2 | 0 1          row = slot - slab * slots_per_slab

A batched copy is therefore grouped per slab (:meth:`HostPool.split_by_slab`) and can never run
across a slab boundary: each group indexes one tensor.

Pinning uses ``cudaHostRegister`` on plain allocations rather than ``pin_memory=True``, because
PyTorch's pinned allocator rounds every request up to a power of two (a 300 GiB pool would take
512 GiB). Registered memory is mapped into the device's unified address space, which is what lets
the transfer kernel read and write it directly.
"""

from __future__ import annotations

import math
import mmap
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..config import DEFAULT_HOST_LAYOUT, HOST_LAYOUTS, HostLayout, KVLayout
from ..errors import CapacityError, ConfigError, PinnedMemoryError, PoolInvariantError
from .pool import torch_dtype

# The default layout (config.DEFAULT_HOST_LAYOUT, page_first): ``kvstrata bench transfer`` on the
# H200 moves one layer at the same speed in both layouts (docs/benchmarks.md), so the default is
# the one that also serves the disk tier: a page's layers are one extent (one write per page and
# payload on spill), in payloads x slabs allocations instead of payloads x layers x slabs.
#: Largest single allocation (one slab tensor); larger pools are split.
DEFAULT_MAX_ALLOC_BYTES = 480 * 2**30
_OS_PAGE = mmap.PAGESIZE


def mem_available_bytes() -> int | None:
    """Memory the machine can still give out (``MemAvailable``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def _register(cudart: Any, tensor: torch.Tensor) -> None:
    # Flags 0 (cudaHostRegisterDefault): with unified addressing the range is mapped and portable.
    err = cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)
    if int(err) != 0:
        raise PinnedMemoryError(
            f"cannot pin {tensor.nbytes / 2**30:.2f} GiB of host memory (cudaHostRegister error "
            f"{int(err)}); lower the L2 size (--l2-tokens / --l2-gib), raise the locked-memory "
            "limit (ulimit -l), or run with pinning off"
        )


def _unregister(cudart: Any, tensors: list[torch.Tensor]) -> None:
    # Runs before the tensors are freed: the finalizer holds them until then.
    for t in tensors:
        cudart.cudaHostUnregister(t.data_ptr())
    tensors.clear()


class HostPool:
    """Per-payload, per-layer page storage of one rank in host memory, in slabs.

    layout / page_size: what a page holds, as for the device pool (they must agree).
    num_slots: host pages this rank stores (the engine converts --l2-tokens / --l2-gib).
    host_layout: ``"layer_first"`` or ``"page_first"`` (module docstring).
    pin: pin with ``cudaHostRegister``; None pins exactly when CUDA is available.
    max_alloc_bytes: the largest single allocation; the pool is split into slabs below it.
    check_memory: refuse a pool larger than the machine's available memory.
    """

    def __init__(
        self,
        layout: KVLayout,
        page_size: int,
        num_slots: int,
        host_layout: HostLayout = DEFAULT_HOST_LAYOUT,
        pin: bool | None = None,
        max_alloc_bytes: int = DEFAULT_MAX_ALLOC_BYTES,
        check_memory: bool = True,
    ) -> None:
        if page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 1:
            raise ConfigError(
                f"a host pool needs at least one slot, got {num_slots}; raise the L2 size"
            )
        if host_layout not in HOST_LAYOUTS:
            raise ConfigError(f"host layout must be one of {HOST_LAYOUTS}, got {host_layout!r}")
        if max_alloc_bytes < 1:
            raise ConfigError(f"max_alloc_bytes must be >= 1, got {max_alloc_bytes}")
        cuda = torch.cuda.is_available()
        if pin is None:
            pin = cuda
        elif pin and not cuda:
            raise ConfigError(
                "pin=True needs CUDA, which this machine lacks; use pin=None or False"
            )
        self.layout = layout
        self.page_size = page_size
        self.num_slots = num_slots
        self.host_layout: HostLayout = host_layout
        self.pinned = pin
        self.max_alloc_bytes = max_alloc_bytes

        # Bytes of one slot in one allocation: the largest over payloads sets the slab size.
        slot_bytes = max(
            page_size * (1 if host_layout == "layer_first" else layout.layers(p)) * p.token_bytes
            for p in layout.payloads
        )
        if slot_bytes > max_alloc_bytes:
            raise ConfigError(
                f"one host page takes {slot_bytes} bytes in one allocation, more than the "
                f"per-allocation cap of {max_alloc_bytes}; raise the cap or use layer_first"
            )
        self.slots_per_slab = min(num_slots, max_alloc_bytes // slot_bytes)
        self.num_slabs = -(-num_slots // self.slots_per_slab)

        if check_memory:
            available = mem_available_bytes()
            if available is not None and self.total_bytes > available:
                raise CapacityError(
                    f"an L2 host pool of {self.total_bytes / 2**30:.2f} GiB ({num_slots} pages of "
                    f"{self.page_bytes} bytes) does not fit in the {available / 2**30:.2f} GiB this "
                    "machine has available (MemAvailable); use a smaller L2 (--l2-tokens or --l2-gib)"
                )

        # _slabs[payload][layer][slab] (layer_first) or _slabs[payload][0][slab] (page_first).
        self._slabs: dict[str, list[list[torch.Tensor]]] = {}
        # What this pool pinned (torch's is_pinned() knows only its own pinned allocator).
        self._registered: list[torch.Tensor] = []
        self._cudart = torch.cuda.cudart() if pin else None
        self._finalizer = weakref.finalize(self, _unregister, self._cudart, self._registered)
        for spec in layout.payloads:
            dtype = torch_dtype(spec.dtype)
            per_layer_shape = (page_size, *spec.token_shape)
            layers = layout.layers(spec)
            if host_layout == "page_first":
                per_layer_shape = (layers, *per_layer_shape)
            groups = []
            for _ in range(layers if host_layout == "layer_first" else 1):
                slabs = []
                for slab in range(self.num_slabs):
                    start, stop = self.slab_bounds(slab)
                    slabs.append(self._allocate((stop - start, *per_layer_shape), dtype))
                groups.append(slabs)
            self._slabs[spec.name] = groups

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        try:
            if not self.pinned:
                return torch.empty(shape, dtype=dtype)
            # Pinning works on whole OS pages, and registering a page twice fails: give every
            # slab pages of its own (page-aligned start, size rounded up to pages).
            raw = torch.empty(nbytes + 2 * _OS_PAGE, dtype=torch.uint8)
        except RuntimeError as err:
            raise CapacityError(
                f"cannot allocate a {nbytes / 2**30:.2f} GiB host slab: "
                f"{str(err).splitlines()[0]}; use a smaller L2 (--l2-tokens or --l2-gib)"
            ) from None
        start = -raw.data_ptr() % _OS_PAGE
        region = raw[start : start + -(-nbytes // _OS_PAGE) * _OS_PAGE]
        _register(self._cudart, region)
        tensor = region[:nbytes].view(dtype).view(shape)
        self._registered.append(tensor)
        return tensor

    @classmethod
    def borrow(
        cls, layout: KVLayout, page_size: int, slabs: dict[str, list[torch.Tensor]]
    ) -> HostPool:
        """A ``page_first`` pool over memory another owner allocated (another engine's host
        pool, a caller's buffers): nothing is allocated, pinned or freed here.

        ``slabs[payload]`` lists that payload's slab tensors, each
        ``[rows, layers, page_size, *token_shape]`` and contiguous; every payload has the same
        row counts, all but the last slab the same. Host slot ``s`` is row ``s`` counted across
        the slabs. Raises ``ConfigError`` when the tensors do not have that geometry.
        """
        names = [p.name for p in layout.payloads]
        if sorted(slabs) != sorted(names):
            raise ConfigError(f"borrowed slabs name payloads {sorted(slabs)}, not {sorted(names)}")
        rows = [int(t.shape[0]) if t.dim() else 0 for t in slabs[names[0]]]
        if not rows or min(rows) < 1 or any(r != rows[0] for r in rows[:-1]) or rows[-1] > rows[0]:
            raise ConfigError(f"borrowed slabs hold {rows} rows; all but the last must be equal")
        pool = cls.__new__(cls)
        pool.layout, pool.page_size, pool.num_slots = layout, page_size, sum(rows)
        pool.host_layout, pool.pinned = "page_first", False
        pool.slots_per_slab, pool.num_slabs = rows[0], len(rows)
        pool.max_alloc_bytes = max(t.nbytes for ts in slabs.values() for t in ts)
        pool._slabs = {name: [list(slabs[name])] for name in names}
        pool._registered = []
        pool._cudart = None
        pool._finalizer = weakref.finalize(pool, _unregister, None, pool._registered)
        try:
            pool.check()
        except PoolInvariantError as err:
            raise ConfigError(f"borrowed slabs do not form a host pool: {err}") from None
        return pool

    @staticmethod
    def slots_for_bytes(layout: KVLayout, page_size: int, num_bytes: int) -> int:
        """How many whole pages of ``layout`` fit in ``num_bytes`` (``--l2-gib`` to slots)."""
        return num_bytes // layout.page_bytes(page_size)

    # -- geometry --------------------------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        """Bytes of one slot across all payloads and layers."""
        return self.layout.page_bytes(self.page_size)

    @property
    def total_bytes(self) -> int:
        return self.page_bytes * self.num_slots

    def check_slots(self, host_slots: Sequence[int], distinct: bool = False) -> list[int]:
        """``host_slots`` as Python ints, each a slot of this pool (ConfigError otherwise), and
        with ``distinct`` each at most once: a read lands every page in its own slot, so a slot
        given twice would let a later page overwrite an earlier one already reported read."""
        slots = host_slots if isinstance(host_slots, np.ndarray) else np.asarray(host_slots)
        if slots.dtype.kind in "iub":  # integers: one pass, not one Python test a slot
            if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
                bad = slots[(slots < 0) | (slots >= self.num_slots)][:5].tolist()
                raise ConfigError(f"host slots {bad} are outside [0, {self.num_slots})")
        else:
            bad = [s for s in host_slots if not 0 <= s < self.num_slots]
            if bad or not all(float(s).is_integer() for s in host_slots):
                raise ConfigError(
                    f"host slots must be integers in [0, {self.num_slots}), got "
                    f"{list(host_slots)[:5]}"
                )
        out: list[int] = slots.astype(np.int64, copy=False).tolist()
        if distinct and len(set(out)) != len(out):
            raise ConfigError("host slots must be distinct, one per page read")
        return out

    def slab_bounds(self, slab: int) -> tuple[int, int]:
        """The host slots ``[start, stop)`` that slab ``slab`` stores."""
        start = slab * self.slots_per_slab
        return start, min(start + self.slots_per_slab, self.num_slots)

    def split_by_slab(
        self, slots: torch.Tensor
    ) -> list[tuple[int, torch.Tensor | None, torch.Tensor]]:
        """Group host ``slots`` (a CPU int64 tensor) by slab.

        Returns ``(slab, positions, rows)`` per slab that holds any of them: ``positions`` indexes
        ``slots`` (None when every slot is in that slab, in order) and ``rows`` are slab-local.
        """
        if self.num_slabs == 1:
            return [(0, None, slots)]
        slab_of = torch.div(slots, self.slots_per_slab, rounding_mode="floor")
        order = torch.argsort(slab_of, stable=True)
        counts = torch.bincount(slab_of, minlength=self.num_slabs).tolist()
        groups: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []
        start = 0
        for slab, count in enumerate(counts):
            if count:
                positions = order[start : start + count]
                groups.append((slab, positions, slots[positions] - slab * self.slots_per_slab))
            start += count
        return groups

    # -- storage ---------------------------------------------------------------------------------

    def _group(self, payload: str, layer: int) -> list[torch.Tensor]:
        groups = self._slabs.get(payload)
        if groups is None:
            raise ConfigError(f"no payload {payload!r} in this pool; it has {sorted(self._slabs)}")
        layers = self.layout.layers(payload)
        if not 0 <= layer < layers:
            raise ConfigError(f"layer {layer} is outside [0, {layers}) for payload {payload!r}")
        return groups[layer if self.host_layout == "layer_first" else 0]

    def slab_tensor(self, payload: str, layer: int, slab: int) -> torch.Tensor:
        """The contiguous allocation that holds ``payload``'s pages of ``layer`` in ``slab``
        (in ``page_first`` the same tensor for every layer)."""
        return self._group(payload, layer)[slab]

    def view(self, payload: str, layer: int, slab: int) -> torch.Tensor:
        """``[slab rows, page_size, *token_shape]``: one layer's pages of ``payload`` in ``slab``
        (a strided view in ``page_first``)."""
        t = self.slab_tensor(payload, layer, slab)
        return t if self.host_layout == "layer_first" else t[:, layer]

    def page_geometry(self, payload: str, layer: int) -> tuple[int, int, int]:
        """``(slot stride, layer offset, page bytes)`` in bytes: host row ``r`` of ``layer`` is the
        ``page bytes`` starting at byte ``r * stride + offset`` of its slab tensor."""
        page_bytes = self.page_size * self.layout.payload(payload).token_bytes
        if self.host_layout == "layer_first":
            return page_bytes, 0, page_bytes
        return self.layout.layers(payload) * page_bytes, layer * page_bytes, page_bytes

    def page(self, payload: str, layer: int, slot: int) -> torch.Tensor:
        """One page of ``payload`` in ``layer``: ``[page_size, *token_shape]`` (a view)."""
        if not 0 <= slot < self.num_slots:
            raise ConfigError(f"host slot {slot} is outside [0, {self.num_slots})")
        slab = slot // self.slots_per_slab
        return self.view(payload, layer, slab)[slot - slab * self.slots_per_slab]

    def tensors(self) -> list[torch.Tensor]:
        """Every allocation of the pool (each a separate slab tensor)."""
        return [t for groups in self._slabs.values() for slabs in groups for t in slabs]

    # -- invariants ------------------------------------------------------------------------------

    def check(self) -> None:
        """Verify: slabs partition the slots, every allocation has its shape and dtype, is
        contiguous, within the cap, pinned exactly when the pool is, and no two overlap."""
        covered = sum(stop - start for start, stop in map(self.slab_bounds, range(self.num_slabs)))
        if covered != self.num_slots or self.slab_bounds(self.num_slabs - 1)[1] != self.num_slots:
            raise PoolInvariantError(f"slabs cover {covered} slots, not {self.num_slots}")
        extents = []
        for spec in self.layout.payloads:
            for layer in range(self.layout.layers(spec)):
                for slab in range(self.num_slabs):
                    start, stop = self.slab_bounds(slab)
                    v = self.view(spec.name, layer, slab)
                    if v.shape != (stop - start, self.page_size, *spec.token_shape):
                        raise PoolInvariantError(
                            f"{spec.name} layer {layer} slab {slab}: shape {tuple(v.shape)}"
                        )
                    if v.dtype != torch_dtype(spec.dtype):
                        raise PoolInvariantError(f"{spec.name}: dtype {v.dtype}, not {spec.dtype}")
        for t in self.tensors():
            if not t.is_contiguous() or t.nbytes > self.max_alloc_bytes:
                raise PoolInvariantError(
                    f"a slab of {t.nbytes} bytes is not contiguous or exceeds the cap "
                    f"{self.max_alloc_bytes}"
                )
            if self.pinned != any(t is r for r in self._registered):
                raise PoolInvariantError(f"a slab is {'not ' if self.pinned else ''}pinned")
            extents.append((t.data_ptr(), t.data_ptr() + t.nbytes))
        extents.sort()
        for (_, end), (start, _) in zip(extents, extents[1:], strict=False):
            if start < end:
                raise PoolInvariantError("two slabs share memory")

    def close(self) -> None:
        """Unpin and release the storage now (otherwise when the pool is garbage-collected)."""
        self._slabs.clear()
        self._finalizer()
