"""`eager`: the reference backend, one sequence at a time with plain matmul and softmax in fp32."""

from __future__ import annotations

import torch

from cadenza.attention_backends.base import AttentionBackend, causal_mask, write_kv


class EagerBackend(AttentionBackend):
    """Slow and obviously right: the backend other backends are checked against."""

    name = "eager"

    def forward(self, q, k, v, kv_cache, meta):
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        starts = meta.query_start_loc.tolist()
        for i, seq_len in enumerate(meta.seq_lens_list):
            start, end = starts[i], starts[i + 1]
            num_blocks = -(-seq_len // self.block_size)
            blocks = meta.block_tables[i, :num_blocks]
            keys = kv_cache[0][blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len].float()
            values = kv_cache[1][blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len].float()
            keys = keys.repeat_interleave(group, dim=1)  # [S, H, D]
            values = values.repeat_interleave(group, dim=1)
            query = q[start:end].float()  # [Q, H, D]
            scores = torch.einsum("qhd,khd->hqk", query, keys) * self.scale
            positions = torch.arange(seq_len - (end - start), seq_len)
            allowed = causal_mask(positions, torch.arange(seq_len), torch.tensor(seq_len), self.sliding_window)
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
        return out
