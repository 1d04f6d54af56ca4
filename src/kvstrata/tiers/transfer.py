"""Moving KV pages between tiers: the only code that copies KV bytes from one tier to another.

The API the engine calls, one *ticket* (a caller-chosen int, unique among tickets in flight) per
batch of pages moved together, one call per layer::

    t = Transfer(device_pool, host_pool)              # CUDA path when the device pool is on CUDA
    t.d2h(ticket, layer, device_slots, host_slots)    # back up one layer, all payloads
    t.h2d(ticket, layer, host_slots, device_slots)    # load one layer back, all payloads
    t.wait_layer(ticket, layer)                       # current stream waits for that layer's load
    t.close(ticket, num_layers)                       # no more layers for this ticket
    for done in t.poll(): ...                         # Completion(ticket, ok, error), never blocks
    t.wait(ticket, timeout_s) / t.synchronize(timeout_s)   # bounded waits (tests, shutdown)
    t.stats()                                         # TransferStats

Slots are 1-D int64 CPU tensors or numpy arrays (the allocators' output), checked against both
pools on the CPU, so nothing on the submitting path waits for the device.

CUDA path: d2h copies run on a store stream and h2d copies on a load stream (PCIe is full duplex).
Each call first makes its stream wait for an event recorded on the current (compute) stream, so a
backup reads the KV the layer has just written and a load cannot overwrite device pages that
queued compute still reads. The copy itself is :mod:`kvstrata.tiers.transfer_kernel` (a Triton kernel
over unified addressing), one launch per payload and host slab; every call records an event, which
is what ``wait_layer`` waits for and ``poll`` queries. CPU path: the same copies with
``index_select``/``index_copy_``, synchronous, so ``poll`` returns tickets as soon as they close.

Contract: until ``poll`` hands a ticket back the caller keeps its device and host slots allocated
and unchanged (tree locks and host refs); ``wait_layer`` is called before that ``poll``. Completions
come back in close order per direction. A copy that raises marks its ticket failed: its remaining
layers are not copied, it is counted, and ``poll`` reports ``ok=False`` with the error; there is no
slower path to fall back to. ``wait_layer`` on a failed load raises :class:`TransferError` so the
forward cannot read pages that never arrived.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import torch

from ..errors import ConfigError, TransferError, TransferTimeoutError
from . import transfer_kernel
from .host_pool import HostPool
from .pool import DevicePool

Direction = Literal["d2h", "h2d"]
Slots = torch.Tensor | npt.NDArray[np.integer]
Backend = Literal["auto", "torch", "triton"]


class Completion(NamedTuple):
    """A ticket whose copies all finished: ``ok``, or failed with ``error``."""

    ticket: int
    ok: bool
    error: str | None


@dataclass(frozen=True, slots=True)
class TransferStats:
    """Counters since construction. Pages and bytes count completed, successful tickets (a page
    counts once per ticket; bytes are every layer and payload); copies and tickets that failed
    are counted apart; in-flight tickets are those not yet returned by ``poll``."""

    d2h_pages: int
    d2h_bytes: int
    h2d_pages: int
    h2d_bytes: int
    failed_copies: int
    failed_tickets: int
    in_flight_tickets: int
    d2h_submitted_bytes: int = 0  # submitted so far, landed or not (what a step asked to move)
    h2d_submitted_bytes: int = 0


@dataclass
class _Ticket:
    ticket: int
    direction: Direction
    layers: dict[int, torch.cuda.Event | None] = field(default_factory=dict)
    pages: int | None = None
    bytes: int = 0
    error: str | None = None
    missing: set[int] = field(default_factory=set)  # layers not copied (failed, or after a failure)
    closed: bool = False
    last: torch.cuda.Event | None = None  # the latest copy's event: the ticket's completion
    keep: list[torch.Tensor] = field(default_factory=list)  # what in-flight copies read


class _Copier(Protocol):
    def copy(
        self, direction: Direction, payload: str, layer: int, slab: int,
        device_slots: torch.Tensor, host_rows: torch.Tensor,
    ) -> None: ...  # fmt: skip


class TorchCopier:
    """CPU path: index ops between the pools' tensors, viewed as ``[rows, page words]`` (torch's
    row gather and scatter are far faster on 2-D word arrays than on bf16 page tensors)."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self._rows: dict[tuple[str, int, int], torch.Tensor] = {}  # (payload, layer, slab)

    def _view(self, payload: str, layer: int, slab: int) -> torch.Tensor:
        rows = self._rows.get((payload, layer, slab))
        if rows is None:
            stride, offset, page_bytes = self.host_pool.page_geometry(payload, layer)
            word = transfer_kernel.word_dtype(page_bytes)
            w, page = word.itemsize, page_bytes // word.itemsize
            if slab < 0:  # the device pool's buffer: one page per row
                t = transfer_kernel.as_words(self.device_pool.buffer(payload, layer), word)
                rows = t.view(-1, page)
            else:  # a host slab: rows of ``stride`` bytes, this layer's page at ``offset``
                t = transfer_kernel.as_words(self.host_pool.slab_tensor(payload, layer, slab), word)
                rows = t.view(-1, stride // w)[:, offset // w : offset // w + page]
            self._rows[(payload, layer, slab)] = rows
        return rows

    def copy(
        self, direction: Direction, payload: str, layer: int, slab: int,
        device_slots: torch.Tensor, host_rows: torch.Tensor,
    ) -> None:  # fmt: skip
        dev = self._view(payload, layer, -1)
        host = self._view(payload, layer, slab)
        if direction == "d2h":
            host.index_copy_(0, host_rows, dev.index_select(0, device_slots))
        else:
            dev.index_copy_(0, device_slots, host.index_select(0, host_rows))


class TritonCopier:
    """CUDA path (or Triton's interpreter on CPU): one kernel launch per payload and host slab."""

    def __init__(
        self, device_pool: DevicePool, host_pool: HostPool, config: transfer_kernel.KernelConfig
    ) -> None:
        transfer_kernel.require_triton()
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.config = config
        self._words: dict[tuple[str, int, int], torch.Tensor] = {}  # (payload, layer, slab)
        # Per payload: word dtype, page length and host slot stride in words, page_first.
        page_first = host_pool.host_layout == "page_first"
        self._geometry: dict[str, tuple[torch.dtype, int, int, bool]] = {}
        for spec in device_pool.layout.payloads:
            stride, _, page_bytes = host_pool.page_geometry(spec.name, 0)
            word = transfer_kernel.word_dtype(page_bytes)
            w = word.itemsize
            self._geometry[spec.name] = (word, page_bytes // w, stride // w, page_first)

    def _flat(
        self, key: tuple[str, int, int], tensor: torch.Tensor, word: torch.dtype
    ) -> torch.Tensor:
        flat = self._words.get(key)
        if flat is None:
            flat = self._words[key] = transfer_kernel.as_words(tensor, word)
        return flat

    def copy(
        self, direction: Direction, payload: str, layer: int, slab: int,
        device_slots: torch.Tensor, host_rows: torch.Tensor,
    ) -> None:  # fmt: skip
        word, chunk, host_stride, page_first = self._geometry[payload]
        dev = self._flat((payload, layer, -1), self.device_pool.buffer(payload, layer), word)
        # In page_first one slab tensor serves every layer, at offset layer * chunk.
        host_key = (payload, -1 if page_first else layer, slab)
        host = self._flat(host_key, self.host_pool.slab_tensor(payload, layer, slab), word)
        # A device row is one whole page of one layer: stride one page, offset 0.
        dev_geo, host_geo = (chunk, 0), (host_stride, layer * chunk if page_first else 0)
        if direction == "d2h":
            src, dst, src_slots, dst_slots, src_geo, dst_geo = (
                dev, host, device_slots, host_rows, dev_geo, host_geo
            )  # fmt: skip
        else:
            src, dst, src_slots, dst_slots, src_geo, dst_geo = (
                host, dev, host_rows, device_slots, host_geo, dev_geo
            )  # fmt: skip
        transfer_kernel.copy_pages(
            src, dst, src_slots, dst_slots,
            src_stride=src_geo[0], dst_stride=dst_geo[0],
            src_offset=src_geo[1], dst_offset=dst_geo[1],
            chunk=chunk, config=self.config,
        )  # fmt: skip


def _as_slots(slots: Slots, what: str, num_slots: int) -> torch.Tensor:
    """A 1-D int64 CPU tensor of ``slots``, checked to lie in ``[0, num_slots)``."""
    t = torch.from_numpy(np.ascontiguousarray(slots)) if isinstance(slots, np.ndarray) else slots
    if t.device.type != "cpu" or t.dim() != 1 or t.dtype not in (torch.int64, torch.int32):
        raise TransferError(
            f"{what} slots must be a 1-D integer CPU tensor or numpy array, got "
            f"shape {tuple(t.shape)} {t.dtype} on {t.device}"
        )
    t = t.to(torch.int64)
    if t.numel():
        lo, hi = (int(x) for x in torch.aminmax(t))
        if lo < 0 or hi >= num_slots:
            raise TransferError(f"{what} slots must lie in [0, {num_slots}), got {lo}..{hi}")
    return t


class Transfer:
    """Every copy of KV pages between the device pool (L1) and the host pool (L2).

    backend: ``"auto"`` (Triton on CUDA, torch index ops on CPU), ``"torch"`` (CPU pools only) or
        ``"triton"`` (CUDA, or Triton's CPU interpreter with ``TRITON_INTERPRET=1``, for tests).
    kernel: launch shape of the Triton kernel.
    """

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        backend: Backend = "auto",
        kernel: transfer_kernel.KernelConfig | None = None,
    ) -> None:
        if device_pool.layout != host_pool.layout or device_pool.page_size != host_pool.page_size:
            raise ConfigError(
                "the device and host pools hold different pages (layout or page size differ); "
                "build both from the same KVLayout and page_size"
            )
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.device = device_pool.device
        self.cuda = self.device.type == "cuda"
        if backend == "auto":
            backend = "triton" if self.cuda else "torch"
        if backend == "torch" and self.cuda:
            raise ConfigError(
                "the torch backend copies between CPU pools only; on CUDA the transfer path is "
                "the Triton kernel (backend='triton'; pip install 'kvstrata[gpu]')"
            )
        if backend == "triton" and not self.cuda and not transfer_kernel.interpreting():
            raise ConfigError(
                "backend='triton' with a CPU device pool runs only in Triton's interpreter "
                "(TRITON_INTERPRET=1, for tests); use backend='auto'"
            )
        if self.cuda and not host_pool.pinned:
            raise ConfigError(
                "the CUDA transfer path reads and writes host pages through unified addressing, "
                "so the host pool must be pinned (pin=None or True)"
            )
        self.backend = backend
        self.copier: _Copier = (
            TritonCopier(device_pool, host_pool, kernel or transfer_kernel.KernelConfig())
            if backend == "triton"
            else TorchCopier(device_pool, host_pool)
        )
        self._streams: dict[Direction, torch.cuda.Stream] = {}
        if self.cuda:
            self._streams = {
                "d2h": torch.cuda.Stream(self.device),
                "h2d": torch.cuda.Stream(self.device),
            }
        self._tickets: dict[int, _Ticket] = {}
        self._closed: dict[Direction, deque[_Ticket]] = {"d2h": deque(), "h2d": deque()}
        layout = device_pool.layout  # bytes of one page in each layer (payloads may skip some)
        self._layer_page_bytes = [
            device_pool.page_size * layout.layer_bytes(layer) for layer in range(layout.num_layers)
        ]
        self._pages = {"d2h": 0, "h2d": 0}
        self._bytes = {"d2h": 0, "h2d": 0}
        self._submitted = {"d2h": 0, "h2d": 0}
        self._failed_copies = 0
        self._failed_tickets = 0

    # -- submitting ------------------------------------------------------------------------------

    def d2h(self, ticket: int, layer: int, device_slots: Slots, host_slots: Slots) -> None:
        """Copy one layer (every payload) of device pages to host pages; asynchronous on CUDA,
        where it reads what the current stream has written by the time of the call."""
        self._submit("d2h", ticket, layer, device_slots, host_slots)

    def h2d(self, ticket: int, layer: int, host_slots: Slots, device_slots: Slots) -> None:
        """Copy one layer (every payload) of host pages to device pages; asynchronous on CUDA,
        where the consumer makes its stream wait with :meth:`wait_layer`."""
        self._submit("h2d", ticket, layer, device_slots, host_slots)

    def _submit(
        self, direction: Direction, ticket: int, layer: int, device_slots: Slots, host_slots: Slots
    ) -> None:
        rec = self._tickets.get(ticket)
        if rec is not None and (rec.closed or rec.direction != direction):
            state = "closed" if rec.closed else f"a {rec.direction} ticket"
            raise TransferError(f"ticket {ticket} is {state}; a {direction} copy needs its own")
        if not 0 <= layer < self.device_pool.layout.num_layers or (
            rec is not None and layer in rec.layers
        ):
            raise TransferError(
                f"ticket {ticket}: layer {layer} is out of range or submitted twice"
            )
        dev = _as_slots(device_slots, "device", self.device_pool.num_slots)
        host = _as_slots(host_slots, "host", self.host_pool.num_slots)
        if dev.numel() != host.numel() or (rec is not None and rec.pages != dev.numel()):
            raise TransferError(
                f"ticket {ticket} layer {layer}: {dev.numel()} device and {host.numel()} host "
                f"slots{f' (earlier layers moved {rec.pages} pages)' if rec else ''}"
            )
        if rec is None:
            rec = self._tickets[ticket] = _Ticket(ticket, direction, pages=dev.numel())
        rec.layers[layer] = None
        if rec.error is not None:
            rec.missing.add(layer)
            return  # a failed ticket copies nothing more
        try:
            # Always in inference mode: a forward's hooks submit from inside it, so views the
            # copier caches there are inference tensors, which only inference mode may update.
            with torch.inference_mode():
                rec.layers[layer] = self._copy_layer(direction, layer, dev, host, rec)
        except RuntimeError as err:  # torch, Triton launch and CUDA errors: the ticket reports it
            rec.error = f"{direction} layer {layer}: {str(err).strip().splitlines()[0]}"
            rec.missing.add(layer)
            self._failed_copies += 1
            return
        rec.bytes += dev.numel() * self._layer_page_bytes[layer]
        self._submitted[direction] += dev.numel() * self._layer_page_bytes[layer]

    def _copy_layer(
        self, direction: Direction, layer: int, dev: torch.Tensor, host: torch.Tensor, rec: _Ticket
    ) -> torch.cuda.Event | None:
        groups = self.host_pool.split_by_slab(host)
        # Per slab: the device slots and slab rows of the pages it holds (CPU tensors).
        pairs = [(slab, dev if pos is None else dev[pos], rows) for slab, pos, rows in groups]
        if not self.cuda:
            self._launch(direction, layer, pairs)
            return None
        stream = self._streams[direction]
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            # One upload of every index of this layer, from pinned memory: no host sync. The
            # pinned allocator keeps the block until the copy that reads it has run.
            staged = torch.empty((2, dev.numel()), dtype=torch.int64, pin_memory=True)
            torch.cat([d for _, d, _ in pairs], out=staged[0])
            torch.cat([r for _, _, r in pairs], out=staged[1])
            on_device = staged.to(self.device, non_blocking=True)
            bounds = np.cumsum([0] + [d.numel() for _, d, _ in pairs]).tolist()
            self._launch(
                direction,
                layer,
                [
                    (slab, on_device[0, a:b], on_device[1, a:b])
                    for (slab, _, _), a, b in zip(pairs, bounds, bounds[1:], strict=False)
                ],
            )
            done = torch.cuda.Event()
            done.record(stream)
        rec.keep += [staged, on_device]  # alive until the ticket is handed back
        rec.last = done
        return done

    def _launch(
        self,
        direction: Direction,
        layer: int,
        pairs: list[tuple[int, torch.Tensor, torch.Tensor]],
    ) -> None:
        layout = self.device_pool.layout
        for spec in layout.payloads:
            if layer >= layout.layers(spec):
                continue  # a payload of fewer layers (a speculative draft's)
            for slab, dev_slots, host_rows in pairs:
                self.copier.copy(direction, spec.name, layer, slab, dev_slots, host_rows)

    # -- completing ------------------------------------------------------------------------------

    def close(self, ticket: int, num_layers: int) -> None:
        """Declare ``ticket`` complete once its ``num_layers`` submitted layers land."""
        rec = self._tickets.get(ticket)
        if rec is None or rec.closed:
            raise TransferError(f"ticket {ticket} is {'closed' if rec else 'unknown'}")
        if rec.error is None and len(rec.layers) != num_layers:
            raise TransferError(
                f"ticket {ticket} closed with {len(rec.layers)} of {num_layers} layers submitted"
            )
        rec.closed = True
        self._closed[rec.direction].append(rec)

    def wait_layer(self, ticket: int, layer: int) -> None:
        """Make the current stream wait for ``layer`` of load ``ticket`` (no host sync; a no-op
        on CPU). Raises :class:`TransferError` if that layer's load failed or was skipped."""
        rec = self._tickets.get(ticket)
        if rec is None or rec.direction != "h2d" or layer not in rec.layers:
            raise TransferError(
                f"ticket {ticket} has no load of layer {layer} in flight (wait_layer must come "
                "after h2d and before poll() returns the ticket)"
            )
        if layer in rec.missing:
            raise TransferError(f"load {ticket} failed, layer {layer} never arrived: {rec.error}")
        event = rec.layers[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _landed(self, rec: _Ticket) -> bool:
        if rec.last is None:
            return True
        try:
            return bool(rec.last.query())
        except RuntimeError as err:  # an asynchronous CUDA error surfaces here
            if rec.error is None:
                rec.error = f"{rec.direction}: {str(err).strip().splitlines()[0]}"
                self._failed_copies += 1
            return True

    def poll(self) -> list[Completion]:
        """Tickets whose copies all finished, oldest first per direction (d2h, then h2d); never
        blocks. A returned ticket is forgotten: its slots are the caller's again."""
        out = []
        for queue in self._closed.values():
            while queue and self._landed(queue[0]):
                rec = queue.popleft()
                del self._tickets[rec.ticket]
                if rec.error is None:
                    self._pages[rec.direction] += rec.pages or 0
                    self._bytes[rec.direction] += rec.bytes
                else:
                    self._failed_tickets += 1
                out.append(Completion(rec.ticket, rec.error is None, rec.error))
        return out

    def wait(self, ticket: int, timeout_s: float = 60.0) -> None:
        """Block until closed ``ticket`` has landed (``poll`` still returns it); raise
        :class:`TransferTimeoutError` after ``timeout_s``."""
        rec = self._tickets.get(ticket)
        if rec is None or not rec.closed:
            raise TransferError(
                f"ticket {ticket} is {'not closed' if rec else 'unknown'}; only a closed ticket "
                "in flight can be waited for"
            )
        self._wait_until(lambda: self._landed(rec), f"ticket {ticket} ({rec.direction})", timeout_s)

    def synchronize(self, timeout_s: float = 60.0) -> None:
        """Block until every copy submitted so far has run (closed or not), within ``timeout_s``."""
        for direction, stream in self._streams.items():
            event = torch.cuda.Event()
            event.record(stream)
            self._wait_until(event.query, f"the {direction} stream", timeout_s)

    @staticmethod
    def _wait_until(done: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pause = 1e-5
        while not done():
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"{what} did not finish within {timeout_s:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def use_kernel(self, config: transfer_kernel.KernelConfig) -> None:
        """Launch later copies with ``config`` (the Triton path only; for benchmarks)."""
        if not isinstance(self.copier, TritonCopier):
            raise ConfigError("the kernel's launch shape applies to the triton backend only")
        self.copier.config = config

    def stream(self, direction: Direction) -> torch.cuda.Stream | None:
        """The stream that runs ``direction``'s copies (None on CPU); for timing and tests."""
        return self._streams.get(direction)

    def stats(self) -> TransferStats:
        return TransferStats(
            d2h_pages=self._pages["d2h"],
            d2h_bytes=self._bytes["d2h"],
            h2d_pages=self._pages["h2d"],
            h2d_bytes=self._bytes["h2d"],
            failed_copies=self._failed_copies,
            failed_tickets=self._failed_tickets,
            in_flight_tickets=len(self._tickets),
            d2h_submitted_bytes=self._submitted["d2h"],
            h2d_submitted_bytes=self._submitted["h2d"],
        )
