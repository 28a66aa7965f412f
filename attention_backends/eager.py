"""`eager`: the reference backend, one sequence at a time with plain matmul and softmax in fp32."""

from __future__ import annotations

import torch

from cadenza.attention_backends.base import AttentionBackend, causal_mask
from cadenza.kernels.kv_layout import read_kv, write_kv


class EagerBackend(AttentionBackend):
    """Slow and obviously right: the backend other backends are checked against."""

    name = "eager"
    supports_int8_kv_cache = True
    supports_attention_sinks = True

    def forward(self, q, k, v, kv_cache, meta, sinks=None):
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        starts = meta.query_start_loc.tolist()
        for i, seq_len in enumerate(meta.seq_lens_list):
            start, end = starts[i], starts[i + 1]
            positions = torch.arange(seq_len, device=meta.block_tables.device)
            slots = meta.block_tables[i, positions // self.block_size] * self.block_size + positions % self.block_size
            keys, values = read_kv(kv_cache, slots, torch.float32)  # [S, KVH, D]
            keys = keys.repeat_interleave(group, dim=1)  # [S, H, D]
            values = values.repeat_interleave(group, dim=1)
            query = q[start:end].float()  # [Q, H, D]
            scores = torch.einsum("qhd,khd->hqk", query, keys) * self.scale
            positions = torch.arange(seq_len - (end - start), seq_len)
            allowed = causal_mask(positions, torch.arange(seq_len), torch.tensor(seq_len), self.sliding_window)
            scores = scores.masked_fill(~allowed, float("-inf"))
            if sinks is not None:  # a column per head in the softmax, dropped after it
                sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
                probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
            else:
                probs = scores.softmax(-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
        return out
