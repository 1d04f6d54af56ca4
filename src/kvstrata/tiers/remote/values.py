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

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from ..disk_buffers import host_page_bytes
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


def encode_value(
    namespace: Namespace, kind: int, page_hash: bytes, host_pool: HostPool, host_slot: int
) -> PageValue:
    """Payload ``kind`` of host slot ``host_slot`` behind its slot header (CRC over the host
    pool's bytes in place)."""
    spec = namespace.payloads[kind]
    views = host_page_bytes(host_pool, spec.name, host_slot)
    parts = tuple(memoryview(t.numpy().data) for t in views)  # 1-D uint8: len() is bytes
    crc = 0
    for part in parts:
        crc = crc32c(part, crc)
    header = bytearray(SLOT_HEADER_BYTES)
    SlotHeader(kind, page_hash, namespace.payload_bytes(kind), crc).pack_into(memoryview(header))
    return PageValue(bytes(header), parts)


def check_value(namespace: Namespace, kind: int, page_hash: bytes, value: bytes) -> str | None:
    """None when ``value`` is payload ``kind`` of ``page_hash`` under ``namespace``, intact;
    else why not."""
    want = value_bytes(namespace, kind)
    if len(value) != want:
        return f"{len(value)} bytes, not {want} (another geometry, or truncated)"
    return check_slot(memoryview(value), kind, page_hash, want - SLOT_HEADER_BYTES)


def decode_value_into(
    namespace: Namespace, kind: int, value: bytes, host_pool: HostPool, host_slot: int
) -> None:
    """Copy a checked value's payload into host slot ``host_slot``."""
    spec = namespace.payloads[kind]
    at = int(np.frombuffer(value, dtype=np.uint8).ctypes.data) + SLOT_HEADER_BYTES
    for dst in host_page_bytes(host_pool, spec.name, host_slot):
        assert dst.dtype == torch.uint8 and dst.is_contiguous()
        ctypes.memmove(dst.data_ptr(), at, dst.numel())
        at += dst.numel()
