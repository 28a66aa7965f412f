"""A paged KV cache's blocks as bytes, for the connectors.

A layer's cache is one tensor [2, num_blocks, ...] (keys, values), or for the int8 cache two (the
int8 data and its scales), so block b of a layer is `tensor[:, b]` of each. A payload is every such
tensor's selected blocks in turn, as raw bytes: [2, n, *rest] per tensor, layer after layer.

On the CPU the copies go through numpy on the raw bytes: no torch operator runs, so no OpenMP team
starts in the transfer's thread beside the compute thread's (see threads/compute_thread.py), and any
dtype (bfloat16 included) copies alike.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def cache_tensors(kv_caches: list) -> list[torch.Tensor]:
    """Every tensor a block lives in, in payload order: per layer the tensor, or `data` and
    `scales` of an `Int8KVCache`."""
    tensors = []
    for layer in kv_caches:
        if isinstance(layer, torch.Tensor):
            tensors.append(layer)
        else:
            tensors += [layer.data, layer.scales]
    return tensors


def block_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes one block takes across `tensors` (keys and values of every layer)."""
    return sum(t[:, 0].numel() * t.element_size() for t in tensors)


def _bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """`tensor` as a numpy uint8 array of shape [2, num_blocks, block_bytes / 2] (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("a KV cache tensor must be contiguous to move its blocks")
    return tensor.view(torch.uint8).numpy().reshape(tensor.shape[0], tensor.shape[1], -1)


def gather_blocks(tensors: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """The payload of `block_ids`: one flat uint8 tensor on the cache's device."""
    n = len(block_ids)
    if tensors and tensors[0].device.type != "cpu":
        index = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
        parts = [t.index_select(1, index).contiguous().view(torch.uint8).reshape(-1) for t in tensors]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    out = np.empty(n * block_nbytes(tensors), dtype=np.uint8)
    offset, index = 0, np.asarray(block_ids, dtype=np.int64)
    for tensor in tensors:
        view = _bytes_view(tensor)
        size = view.shape[0] * n * view.shape[2]
        np.take(view, index, axis=1, out=out[offset : offset + size].reshape(view.shape[0], n, view.shape[2]))
        offset += size
    return torch.from_numpy(out)


def scatter_blocks(tensors: Sequence[torch.Tensor], block_ids: Sequence[int], payload: torch.Tensor) -> None:
    """Write `payload` (as `gather_blocks` made it, for as many blocks) into `block_ids`."""
    n = len(block_ids)
    if payload.numel() != n * block_nbytes(tensors):
        raise ValueError(f"a payload of {payload.numel()} bytes for {n} blocks of {block_nbytes(tensors)} bytes")
    if tensors and tensors[0].device.type != "cpu":
        index = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
        payload, offset = payload.to(tensors[0].device), 0
        for tensor in tensors:
            size = tensor[:, :n].numel() * tensor.element_size()
            part = payload[offset : offset + size].view(tensor.dtype).view(tensor.shape[0], n, *tensor.shape[2:])
            tensor.index_copy_(1, index, part)
            offset += size
        return
    data, offset, index = payload.numpy(), 0, np.asarray(block_ids, dtype=np.int64)
    for tensor in tensors:
        view = _bytes_view(tensor)
        size = view.shape[0] * n * view.shape[2]
        view[:, index] = data[offset : offset + size].reshape(view.shape[0], n, view.shape[2])
        offset += size
