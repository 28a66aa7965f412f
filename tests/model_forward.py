"""A model's logits for one prompt, through the model's own forward on a fresh paged cache (eager attention)."""

from __future__ import annotations

import torch


def chunk_metadata(start: int, end: int, blocks: int):
    """Attention metadata for positions [start, end) of one sequence whose cache is blocks 0 .. blocks - 1."""
    from cadenza.attention_backends.base import AttentionMetadata

    return AttentionMetadata(
        query_start_loc=torch.tensor([0, end - start]), seq_lens=torch.tensor([end]),
        context_lens=torch.tensor([start]), block_tables=torch.arange(blocks).view(1, -1),
        slot_mapping=torch.arange(start, end), query_lens_list=[end - start], seq_lens_list=[end],
        max_query_len=end - start, max_seq_len=end,
    )  # fmt: skip


def prefill_logits(loaded, token_ids: list[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of a one-sequence prefill of `token_ids`; `loaded` a `LoadedModel`."""
    from cadenza.attention_backends.eager import EagerBackend
    from cadenza.runner.kv_cache import allocate_kv_caches

    arch, block_size, n = loaded.arch, 16, len(token_ids)
    blocks = -(-n // block_size)
    caches = allocate_kv_caches(arch, blocks, block_size, loaded.compute_dtype, torch.device("cpu"))
    def backend_of(window):
        return EagerBackend(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                            scale=arch.softmax_scale, block_size=block_size, sliding_window=window)

    backend = backend_of(arch.sliding_window)
    if arch.layer_windows is not None:  # Gemma 3's local layers attend through a backend of their own
        from cadenza.runtime.shard import layer_window

        loaded.model.use_windowed_backend(backend_of(layer_window(arch)))
    with torch.no_grad():
        hidden = loaded.model(torch.tensor(token_ids), torch.arange(n), caches, chunk_metadata(0, n, blocks), backend)
        return loaded.model.compute_logits(hidden).float()
