"""What the shared tier stores: one Redis key per (namespace, rank, page, payload), and as its
value the disk tier's slot format without the padding.

::

    key    kvstrata:<namespace digest, 64 hex>:r<rank>:{<page hash, 64 hex>}:<payload kind>
    value  64-byte slot header (disk_format.SlotHeader: magic, format, kind, page hash, payload
           length, payload CRC-32C, header CRC-32C) | payload (the page's layers in order)

The key is ASCII so that ``redis-cli --scan --pattern 'kvstrata:<ns>:*'`` lists a namespace and
``SCAN MATCH`` counts one (no glob character can occur in it). The braces are a Redis Cluster hash
tag: every payload of a page lives in the same slot, on the same node. A value is checked on
every read exactly as a disk slot is (``disk_format.check_slot``), plus its exact length: the
page hash in the header chains the namespace digest (``page_hash.py``), so a value of another
namespace, page, payload or geometry fails, and so does any flipped bit.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..disk_format import SLOT_HEADER_BYTES, SlotHeader, check_slot, crc32c
from ..host_pool import HostPool
from ..page_hash import Namespace

KEY_PREFIX = "kvstrata"


def page_key(namespace: Namespace, rank: int, page_hash: bytes, kind: int) -> bytes:
    """The key of payload ``kind`` of page ``page_hash`` stored by ``rank``."""
    return f"{KEY_PREFIX}:{namespace.digest.hex()}:r{rank}:{{{page_hash.hex()}}}:{kind}".encode()


def rank_pattern(namespace: Namespace, rank: int) -> str:
    """The ``SCAN MATCH`` pattern of every key ``rank`` stores under ``namespace``."""
    return f"{KEY_PREFIX}:{namespace.digest.hex()}:r{rank}:*"


def key_kind(key: bytes) -> int | None:
    """The payload kind a key of :func:`page_key`'s form names (None for another form)."""
    head, _, kind = key.rpartition(b":")
    return int(kind) if head and kind.isdigit() else None


def value_bytes(namespace: Namespace, kind: int) -> int:
    """Bytes of one value of payload ``kind``: header and payload."""
    return SLOT_HEADER_BYTES + namespace.payload_bytes(kind)


@dataclass(frozen=True, slots=True)
class PageValue:
    """One value to SET without copying it: its header, then views of the payload's bytes in
    the host pool (one per layer in ``layer_first``, one in ``page_first``). The host slot must
    not change until the SET was sent (``client.RedisClient.set_new`` returns)."""

    header: bytes
    parts: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(len(p) for p in self.parts)


class PoolBytes:
    """A host pool's pages as byte views: one ``memoryview`` per slab (per layer in
    ``layer_first``), cut per slot by slicing, which costs no torch call (each of those
    releases and takes back the GIL that the store's other threads wait for)."""

    def __init__(self, host_pool: HostPool) -> None:
        self.per_slab = host_pool.slots_per_slab
        self._views: dict[str, list[list[memoryview]]] = {}
        self._stride: dict[str, int] = {}
        for spec in host_pool.layout.payloads:
            layer_first = host_pool.host_layout == "layer_first"
            groups = host_pool.layout.layers(spec) if layer_first else 1
            slabs = []
            for g in range(groups):
                row = []
                for slab in range(host_pool.num_slabs):
                    t = host_pool.slab_tensor(spec.name, g, slab)
                    assert t.is_contiguous() and t.device.type == "cpu"
                    row.append(t.reshape(-1).view(torch.uint8).numpy().data)
                slabs.append(row)
            self._views[spec.name] = slabs
            self._stride[spec.name] = host_pool.page_geometry(spec.name, 0)[0]

    def page(self, payload: str, host_slot: int) -> list[memoryview]:
        """The slot's bytes of ``payload`` in layer order (as ``disk_buffers.host_page_bytes``)."""
        slab, row = divmod(host_slot, self.per_slab)
        stride = self._stride[payload]
        return [g[slab][row * stride : (row + 1) * stride] for g in self._views[payload]]


_POOL_BYTES: weakref.WeakKeyDictionary[HostPool, PoolBytes] = weakref.WeakKeyDictionary()


def pool_bytes(host_pool: HostPool) -> PoolBytes:
    """The pool's :class:`PoolBytes`, built at its first use."""
    found = _POOL_BYTES.get(host_pool)
    if found is None:
        found = _POOL_BYTES[host_pool] = PoolBytes(host_pool)
    return found


class PageCodec:
    """One rank's keys and values under one namespace, with everything per kind worked out once
    (key prefix, payload names and lengths): the store calls these for every value it moves."""

    def __init__(self, namespace: Namespace, rank: int) -> None:
        self.namespace = namespace
        self.kinds = range(len(namespace.payloads))
        self.names = [p.name for p in namespace.payloads]
        self.payload_len = [namespace.payload_bytes(k) for k in self.kinds]
        self.value_len = [SLOT_HEADER_BYTES + n for n in self.payload_len]
        self._prefix = f"{KEY_PREFIX}:{namespace.digest.hex()}:r{rank}:{{".encode()
        self._suffix = [f"}}:{k}".encode() for k in self.kinds]

    def keys(self, page_hash: bytes) -> list[bytes]:
        """The keys of every payload of ``page_hash`` (as :func:`page_key`)."""
        head = self._prefix + page_hash.hex().encode()
        return [head + tail for tail in self._suffix]

    def encode(self, kind: int, page_hash: bytes, host_pool: HostPool, host_slot: int) -> PageValue:
        """Payload ``kind`` of host slot ``host_slot`` behind its slot header (CRC over the host
        pool's bytes in place)."""
        parts = tuple(pool_bytes(host_pool).page(self.names[kind], host_slot))
        crc = 0
        for part in parts:
            crc = crc32c(part, crc)
        header = bytearray(SLOT_HEADER_BYTES)
        SlotHeader(kind, page_hash, self.payload_len[kind], crc).pack_into(memoryview(header))
        return PageValue(bytes(header), parts)

    def check(
        self, kind: int, page_hash: bytes, value: bytes | memoryview | Sequence[memoryview]
    ) -> str | None:
        """None when ``value`` is payload ``kind`` of ``page_hash`` under the namespace, intact;
        else why not. ``value`` is one buffer, or the pieces a value was read into (its header,
        then the payload's views: :meth:`payload_views`)."""
        want = self.value_len[kind]
        pieces = [value] if isinstance(value, bytes | memoryview) else value
        got = sum(len(p) for p in pieces)
        if got != want:
            return f"{got} bytes, not {want} (another geometry, or truncated)"
        if len(pieces) == 1:
            return check_slot(memoryview(pieces[0]), kind, page_hash, self.payload_len[kind])
        head, *body = (memoryview(p) for p in pieces)
        return check_slot(head, kind, page_hash, self.payload_len[kind], body=body)

    def payload_views(self, kind: int, host_pool: HostPool, host_slot: int) -> list[memoryview]:
        """Host slot ``host_slot``'s bytes of payload ``kind``, in order: where a fetched value's
        payload is read (after its header)."""
        return pool_bytes(host_pool).page(self.names[kind], host_slot)
