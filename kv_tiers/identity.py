"""The model identity a tier's blocks are written under: a block is only ever read back into the
model, and the cache layout, that computed it.

The identity is a blake2b digest of the weights' fingerprint, the weights' dtype, the block size,
the KV cache dtype and the tensor-parallel shape (each rank holds its heads' share of a block).

The weights' fingerprint is a sample, not a full hash: each file's size and blake2b of its first and
last MiB (a directory: the same over its weights and config files, with their names). Hashing every
byte of an 8B checkpoint (16 GB) would take tens of seconds at each start-up, as long as the
prefill the disk tier saves. The sample changes whenever a checkpoint is replaced: a safetensors
file opens with its header (every tensor's name, shape, dtype and offset), a GGUF with its
metadata and tensor table, and a fine-tune changes the tensors at both ends. Modification times are
left out, so a copied checkpoint keeps its blocks.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLE = 1 << 20  # bytes hashed at each end of a weights file
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".json")


def file_fingerprint(path: Path) -> bytes:
    """blake2b of a file's size and its first and last `SAMPLE` bytes."""
    digest = hashlib.blake2b(digest_size=32)
    size = path.stat().st_size
    digest.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        digest.update(f.read(SAMPLE))
        if size > SAMPLE:
            f.seek(max(SAMPLE, size - SAMPLE))
            digest.update(f.read(SAMPLE))
    return digest.digest()


def weights_fingerprint(source: str | Path | None) -> bytes:
    """The fingerprint of a weights file or directory; a name that is not a local path (a hub id,
    the embedded model) is fingerprinted by its name alone."""
    digest = hashlib.blake2b(digest_size=32)
    path = Path(source) if source is not None else None
    if path is not None and path.is_file():
        digest.update(b"file" + file_fingerprint(path))
    elif path is not None and path.is_dir():
        for file in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES):
            digest.update(file.name.encode() + b"\0" + file_fingerprint(file))
    else:
        digest.update(b"name" + str(source).encode())
    return digest.digest()


def model_identity(
    source: str | Path | None, *, dtype: str, block_size: int, kv_dtype: str, tensor_parallel_size: int = 1
) -> bytes:
    """32 bytes naming the model and the cache layout a block's bytes belong to."""
    digest = hashlib.blake2b(weights_fingerprint(source), digest_size=32)
    digest.update(f"|dtype={dtype}|block_size={block_size}|kv_dtype={kv_dtype}|tp={tensor_parallel_size}".encode())
    return digest.digest()
