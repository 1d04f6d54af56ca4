"""What the cache names a model by: a digest of its weights, never the name a user typed.

The disk tier's namespace and the handoff's layout fingerprint must differ whenever the KV a
model computes differs, or a later run serves another model's KV as its own. ``--model ckpt``
names a different checkpoint in every working directory, a fine-tune saved over a checkpoint
keeps its path, and a preset draws other weights under another ``--seed``; so the id is::

    preset      preset:NAME:seed=S:device=TYPE      (random weights: the name, the seed, and the
                                                     device type whose generator drew them)
    checkpoint  checkpoint:SHA-256                  over the resolved directory, config.json and,
                                                     for each weight file the loader reads, its
                                                     name, size, safetensors header and sampled
                                                     tensor bytes

The samples are every tensor's first and last :data:`SAMPLE_BYTES` and :data:`SAMPLES_PER_TENSOR`
windows evenly between (a tensor of at most :data:`WHOLE_TENSOR_BYTES` is hashed whole): a
checkpoint rewritten in place changes its header (shapes, dtypes, offsets) or the bytes of
every tensor it retrained, and reading ~70 KB a tensor costs a fraction of a second even for a
70B model, so the id is computed afresh at every start and nothing is written beside the user's
checkpoint. Within one process the digest is kept per (file, size, mtime, inode).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from ..errors import CheckpointError
from .loader import _is_checkpoint, _weight_files, read_model_config

#: Bytes hashed from each end of a tensor, and from each window between.
SAMPLE_BYTES = 4096
SAMPLES_PER_TENSOR = 16
#: Tensors up to this size are hashed whole.
WHOLE_TENSOR_BYTES = (SAMPLES_PER_TENSOR + 2) * SAMPLE_BYTES
#: The safetensors format caps its JSON header at 100 MB.
MAX_HEADER_BYTES = 100_000_000

_DIGESTS: dict[tuple[object, ...], str] = {}


def weights_id(
    path_or_preset: str | os.PathLike[str],
    seed: int,
    device: str | torch.device,
    draft: str | os.PathLike[str] | None = None,
) -> str:
    """The id of the weights ``load_model(path_or_preset, device, seed=seed)`` loads (and of a
    speculative ``draft`` loaded beside it). Raises :class:`CheckpointError` for a checkpoint
    whose weight files cannot be read."""
    main = _one_id(path_or_preset, seed, torch.device(device).type)
    if draft is None:
        return main
    return f"{main}+draft:{_one_id(draft, seed, torch.device(device).type)}"


def _one_id(path_or_preset: str | os.PathLike[str], seed: int, device_type: str) -> str:
    if not _is_checkpoint(path_or_preset):
        read_model_config(path_or_preset)  # an unknown name is refused here, as by the loader
        return f"preset:{path_or_preset}:seed={seed}:device={device_type}"
    return f"checkpoint:{checkpoint_digest(Path(path_or_preset))}"


def checkpoint_digest(directory: Path) -> str:
    """The hex SHA-256 of a checkpoint directory's identity (module docstring)."""
    root = directory.resolve()
    config = root / "config.json"
    files = [config, *_weight_files(root)]
    try:
        stats = [os.stat(f) for f in files]
    except OSError as err:
        raise CheckpointError(f"cannot read {err.filename}: {err.strerror}") from None
    key = (
        str(root),
        *(
            (str(f), s.st_size, s.st_mtime_ns, s.st_ino, s.st_dev)
            for f, s in zip(files, stats, strict=True)
        ),
    )
    if key not in _DIGESTS:
        h = hashlib.sha256(b"kvstrata-weights-1\0")
        _field(h, str(root).encode())
        try:
            _field(h, config.read_bytes())
        except OSError as err:
            raise CheckpointError(f"cannot read {config}: {err.strerror}") from None
        for file in files[1:]:
            _field(h, file.relative_to(root).as_posix().encode())
            _hash_safetensors(h, file)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def _field(h: hashlib._Hash, data: bytes) -> None:
    """One length-prefixed field: no two sequences of fields hash alike."""
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def _hash_safetensors(h: hashlib._Hash, path: Path) -> None:
    """The file's size, header and sampled tensor bytes into ``h``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise CheckpointError(f"cannot read weights from {path}: {err.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        h.update(struct.pack("<Q", size))
        head = os.pread(fd, 8, 0)
        (header_len,) = struct.unpack("<Q", head) if len(head) == 8 else (size + 1,)
        if not 0 < header_len <= min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path} is not a safetensors file (bad header length)")
        raw = os.pread(fd, header_len, 8)
        _field(h, raw)
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError):
            raise CheckpointError(f"{path} is not a safetensors file (bad JSON header)") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path} is not a safetensors file (its header is no object)")
        base = 8 + header_len
        for name in sorted(header):
            offsets = header[name].get("data_offsets") if isinstance(header[name], dict) else None
            if name == "__metadata__" or not isinstance(offsets, list) or len(offsets) != 2:
                continue
            begin, end = (int(x) for x in offsets)
            for offset, length in _windows(begin, end):
                _field(h, os.pread(fd, length, base + offset))
    except OSError as err:
        raise CheckpointError(f"cannot read weights from {path}: {err.strerror}") from None
    finally:
        os.close(fd)


def _windows(begin: int, end: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the sampled windows of the tensor at ``[begin, end)``."""
    nbytes = max(end - begin, 0)
    if nbytes <= WHOLE_TENSOR_BYTES:
        return [(begin, nbytes)]
    last = end - SAMPLE_BYTES
    n = SAMPLES_PER_TENSOR + 1
    return [(begin + (last - begin) * i // n, SAMPLE_BYTES) for i in range(n + 1)]
