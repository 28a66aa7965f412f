"""`torch_sdpa`: gathers each sequence's keys from the paged cache and runs PyTorch's fused SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cadenza.attention_backends.base import AttentionBackend, AttentionMetadata, causal_mask, write_kv


class TorchSDPABackend(AttentionBackend):
    """Pads the batch to [B, max_query_len] queries against [B, max_seq_len] gathered keys.

    Padding costs memory proportional to the longest sequence, but runs every sequence in one
    fused call; a batch of pure decodes needs no query padding at all.
    """

    name = "torch_sdpa"

    def begin_step(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        num_seqs, max_q = meta.num_seqs, meta.max_query_len
        blocks_needed = -(-meta.max_seq_len // self.block_size)
        self._block_tables = meta.block_tables[:, :blocks_needed]
        self._max_keys = blocks_needed * self.block_size
        offsets = torch.arange(max_q, device=device)
        query_lens = meta.seq_lens - meta.context_lens
        # Row j of sequence i is query token query_start_loc[i] + j, when j < query_lens[i].
        self._query_valid = offsets[None, :] < query_lens[:, None]  # [B, Q]
        self._query_index = (meta.query_start_loc[:-1, None] + offsets[None, :])[self._query_valid]
        positions = meta.context_lens[:, None] + offsets[None, :]
        key_positions = torch.arange(self._max_keys, device=device)
        mask = causal_mask(positions, key_positions, meta.seq_lens, self.sliding_window)
        self._mask = mask.unsqueeze(1)  # [B, 1, Q, K]
        self._decode_only = meta.is_decode_only
        self._num_seqs, self._max_q = num_seqs, max_q

    def forward(self, q, k, v, kv_cache, meta):
        write_kv(k, v, kv_cache, meta.slot_mapping)
        num_seqs, max_q = self._num_seqs, self._max_q
        keys = kv_cache[0][self._block_tables].view(num_seqs, self._max_keys, self.num_kv_heads, self.head_dim)
        values = kv_cache[1][self._block_tables].view(num_seqs, self._max_keys, self.num_kv_heads, self.head_dim)
        if self._decode_only:
            queries = q.view(num_seqs, 1, self.num_heads, self.head_dim)
        else:
            queries = q.new_zeros(num_seqs, max_q, self.num_heads, self.head_dim)
            queries[self._query_valid] = q
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=self._mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        ).transpose(1, 2)  # [B, Q, H, D]
        if self._decode_only:
            return out.reshape(num_seqs, self.num_heads, self.head_dim)
        return out[self._query_valid]
