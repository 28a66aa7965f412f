"""`torch_sdpa`: gathers each sequence's keys from the paged cache and runs PyTorch's fused SDPA.

Decode-only steps on the CPU, where cadenza's CPU kernels run, skip the gather: the paged decode
kernel reads each key and value where it lies in the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cadenza.attention_backends.base import AttentionBackend, AttentionMetadata, causal_mask, write_kv


class TorchSDPABackend(AttentionBackend):
    """Pads the batch to [B, max_query_len] queries against [B, max_seq_len] gathered keys.

    Padding costs memory proportional to the longest sequence, but runs every sequence in one
    fused call. Everything that depends only on the step (gather and scatter indices, the mask)
    is built once in `begin_step`, not per layer; a mask is skipped where SDPA needs none.
    """

    name = "torch_sdpa"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        from cadenza.models.cpu_features import cpu_has_native_bf16

        # Without native bf16, PyTorch's CPU attention kernels are several times slower in bf16
        # than in float32 (and the softmax is better in float32 anyway): compute there in float32.
        self._upcast = torch.device(self.device).type == "cpu" and not cpu_has_native_bf16()
        self._kernels = None

    def use_cpu_kernels(self, kernels) -> None:
        self._kernels = kernels if torch.device(self.device).type == "cpu" else None

    def begin_step(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        num_seqs, max_q, max_k = meta.num_seqs, meta.max_query_len, meta.max_seq_len
        self._meta = meta
        self._key_slots: torch.Tensor | None = None  # built on first use: the kernel path needs none
        self._decode_only = meta.is_decode_only
        self._num_seqs, self._max_q, self._max_k = num_seqs, max_q, max_k
        self._paged_decode = self._decode_only and self._kernels is not None
        key_positions = torch.arange(max_k, device=device)
        if not self._decode_only:
            offsets = torch.arange(max_q, device=device)
            query_lens = meta.seq_lens - meta.context_lens
            valid = offsets[None, :] < query_lens[:, None]  # [B, Q]
            # Row j of sequence i sits at i * max_q + j of the padded batch.
            self._padded_rows = (torch.arange(num_seqs, device=device)[:, None] * max_q + offsets)[valid]
        uniform = min(meta.seq_lens_list) == max_k and (self.sliding_window is None or self.sliding_window >= max_k)
        self._is_causal = False
        self._mask_bool: torch.Tensor | None = None
        if self._decode_only and uniform:
            self._mask_bool = None  # one query per sequence, every key visible: no mask at all
        elif num_seqs == 1 and max_q == max_k and self.sliding_window is None:
            self._is_causal = True  # a fresh prompt: plain causal attention
        else:
            positions = meta.context_lens[:, None] + torch.arange(max_q, device=device)[None, :]
            self._mask_bool = causal_mask(positions, key_positions, meta.seq_lens, self.sliding_window).unsqueeze(1)
        self._mask: torch.Tensor | None = None

    def _additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        # SDPA would turn a boolean mask into an additive one on every call; do it once per step.
        if self._mask_bool is None:
            return None
        if self._mask is None or self._mask.dtype != dtype:
            self._mask = torch.zeros(self._mask_bool.shape, dtype=dtype, device=self._mask_bool.device)
            self._mask.masked_fill_(~self._mask_bool, float("-inf"))
        return self._mask

    def _gather_slots(self) -> torch.Tensor:
        # The flat cache slot of every key position each sequence attends to (padding reads slot 0,
        # which the mask then hides): exactly max_seq_len keys, not whole blocks.
        if self._key_slots is None:
            meta = self._meta
            key_positions = torch.arange(self._max_k, device=meta.block_tables.device)
            blocks = meta.block_tables.gather(1, (key_positions // self.block_size).expand(self._num_seqs, -1))
            self._key_slots = (blocks * self.block_size + key_positions % self.block_size).reshape(-1)
        return self._key_slots

    def forward(self, q, k, v, kv_cache, meta):
        write_kv(k, v, kv_cache, meta.slot_mapping)
        if self._paged_decode and q.dtype == torch.float32 and kv_cache.dtype == torch.float32:
            return self._kernels.paged_decode_attention(
                q, kv_cache, meta.block_tables, meta.seq_lens, self.scale, self.sliding_window or 0
            )
        num_seqs, max_q, max_k = self._num_seqs, self._max_q, self._max_k
        flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
        slots = self._gather_slots()
        keys = flat[0].index_select(0, slots).view(num_seqs, max_k, self.num_kv_heads, self.head_dim)
        values = flat[1].index_select(0, slots).view(num_seqs, max_k, self.num_kv_heads, self.head_dim)
        if self._decode_only:
            queries = q.view(num_seqs, 1, self.num_heads, self.head_dim)
        else:
            padded = q.new_zeros(num_seqs * max_q, self.num_heads, self.head_dim)
            queries = padded.index_copy_(0, self._padded_rows, q).view(num_seqs, max_q, self.num_heads, self.head_dim)
        compute = torch.float32 if self._upcast and q.dtype != torch.float32 else q.dtype
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2).to(compute),
            keys.transpose(1, 2).to(compute),
            values.transpose(1, 2).to(compute),
            attn_mask=self._additive_mask(compute),
            is_causal=self._is_causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        ).transpose(1, 2).to(q.dtype)  # [B, Q, H, D]
        if self._decode_only:
            return out.reshape(num_seqs, self.num_heads, self.head_dim)
        return out.reshape(num_seqs * max_q, self.num_heads, self.head_dim).index_select(0, self._padded_rows)
