"""`torch_sdpa`: gathers each sequence's keys from the paged cache and runs PyTorch's fused SDPA.

A step that mixes decodes with prefill chunks is attended in two groups, so the decodes' single
query rows are not padded to the longest chunk (a [B, max_q, max_k] attention for B sequences
would cost the whole batch what one chunk costs). Decode groups on the CPU, where cadenza's CPU
kernels run, skip the gather: the paged decode kernel reads keys and values in place (a float32,
bfloat16 or float16 cache for float32 activations, 16-bit rows widened on load; an int8 cache for
any).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cadenza.attention_backends.base import AttentionBackend, AttentionMetadata, causal_mask
from cadenza.kernels.kv_layout import KERNEL_FLOAT_CACHES, Int8KVCache, read_kv, write_kv


@dataclass(slots=True)
class _Group:
    """Sequences attended in one call: padded to [n, max_q] queries against [n, max_k] keys.

    `rows` are the group's query rows in the step's flat batch (None: all of them, in order).
    Everything here depends only on the step, so it is built once in `begin_step`.
    """

    rows: torch.Tensor | None
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    num_seqs: int
    max_q: int
    max_k: int
    padded_rows: torch.Tensor | None  # where each query row sits in the padded [n * max_q] batch
    mask_bool: torch.Tensor | None
    is_causal: bool
    key_slots: torch.Tensor | None = None  # built on first use: the kernel path needs none
    mask: torch.Tensor | None = None  # mask_bool as an additive mask, built on first use
    sink_base: torch.Tensor | None = None  # the additive mask [n, H, Q, K] sinks extend, built on first use

    @property
    def is_decode(self) -> bool:
        return self.max_q == 1



def _packed_f32(x: torch.Tensor) -> bool:
    """Whether the kernels' cache write takes `x` [T, heads, D] as it is."""
    return x.dtype == torch.float32 and x.stride(-1) == 1 and x.stride(1) == x.shape[2]


# The longest chunk the whole-step path takes: its rows each read their keys as a decode does, which
# is what speculative verification needs (a decode and up to 16 guesses, speculative.num_tokens'
# most: every verified row is then its decode step, bit for bit); a longer prefill chunk is cheaper
# through SDPA, which reads them once for the chunk.
STACK_MAX_QUERY_LEN = 17


class TorchSDPABackend(AttentionBackend):
    """Pads each group to [n, max_query_len] queries against [n, max_seq_len] gathered keys.

    Padding costs memory proportional to the group's longest sequence, but runs every sequence
    of a group in one fused call. A mask is skipped where SDPA needs none.
    """

    name = "torch_sdpa"
    supports_int8_kv_cache = True
    supports_attention_sinks = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        from cadenza.kernels.cpu.features import cpu_has_native_bf16

        # Without native bf16, PyTorch's CPU attention kernels are several times slower in bf16
        # than in float32 (and the softmax is better in float32 anyway): compute there in float32.
        self._upcast = torch.device(self.device).type == "cpu" and not cpu_has_native_bf16()
        # With it, a prefill chunk of float32 queries over a bfloat16 cache (the cache `auto` gives
        # where the linears round activations to int8) attends in bfloat16: the keys and values are
        # bfloat16 already, the queries' rounding (~2^-9) is below the int8 rounding of the
        # activations they came from, and PyTorch's flash attention then runs on AMX or AVX512-BF16
        # (a 512-token chunk, 32 heads over 8: 12.3 -> 4.9 ms a layer on a Sapphire Rapids core pair).
        self._bf16_chunks = torch.device(self.device).type == "cpu" and cpu_has_native_bf16()
        self._kernels = None
        self._groups: list[_Group] = []

    def use_cpu_kernels(self, kernels) -> None:
        self._kernels = kernels if torch.device(self.device).type == "cpu" else None

    def begin_step(self, meta: AttentionMetadata) -> None:
        query_lens = meta.query_lens_list
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        if 0 < len(decodes) < len(query_lens):
            prefills = [i for i, n in enumerate(query_lens) if n > 1]
            self._groups = [self._group(meta, decodes), self._group(meta, prefills)]
        else:
            self._groups = [self._group(meta, None)]

    def _group(self, meta: AttentionMetadata, seqs: list[int] | None) -> _Group:
        device = meta.slot_mapping.device
        if seqs is None:
            rows, block_tables, seq_lens, context_lens = None, meta.block_tables, meta.seq_lens, meta.context_lens
            query_lens, lens = meta.query_lens_list, meta.seq_lens_list
        else:
            index = torch.tensor(seqs, device=device)
            starts = meta.query_start_loc.tolist()
            rows = torch.tensor([r for i in seqs for r in range(starts[i], starts[i + 1])], device=device)
            block_tables = meta.block_tables.index_select(0, index)
            seq_lens, context_lens = meta.seq_lens.index_select(0, index), meta.context_lens.index_select(0, index)
            query_lens, lens = [meta.query_lens_list[i] for i in seqs], [meta.seq_lens_list[i] for i in seqs]
        num_seqs, max_q, max_k = len(lens), max(query_lens), max(lens)
        padded_rows = None
        if max_q > 1:
            offsets = torch.arange(max_q, device=device)
            valid = offsets[None, :] < (seq_lens - context_lens)[:, None]  # [n, Q]
            # Row j of sequence i sits at i * max_q + j of the padded batch.
            padded_rows = (torch.arange(num_seqs, device=device)[:, None] * max_q + offsets)[valid]
        uniform = min(lens) == max_k and (self.sliding_window is None or self.sliding_window >= max_k)
        mask_bool, is_causal = None, False
        if max_q == 1 and uniform:
            pass  # one query per sequence, every key visible: no mask at all
        elif num_seqs == 1 and max_q == max_k and self.sliding_window is None:
            is_causal = True  # a fresh prompt: plain causal attention
        else:
            positions = context_lens[:, None] + torch.arange(max_q, device=device)[None, :]
            key_positions = torch.arange(max_k, device=device)
            mask_bool = causal_mask(positions, key_positions, seq_lens, self.sliding_window).unsqueeze(1)
        return _Group(rows, block_tables, seq_lens, context_lens, num_seqs, max_q, max_k, padded_rows, mask_bool, is_causal)

    def run_decode_stack(self, layers, h, positions, kv_caches, meta) -> bool:
        """The kernels' whole-step path (`forward`'s kernel calls, in C++ one layer after another),
        on float, bfloat16, float16 or int8 caches. Each query row attends as a decode would: row j of a chunk
        starting at context c sees keys [0, c + j + 1) through its sequence's block table, so a
        speculative step's or a short prefill's rows are computed exactly as decodes are."""
        if self._kernels is None or meta.max_query_len > STACK_MAX_QUERY_LEN:
            return False
        if all(isinstance(c, Int8KVCache) for c in kv_caches):
            caches, scales = [c.data for c in kv_caches], [c.scales for c in kv_caches]
        elif all(isinstance(c, torch.Tensor) and c.dtype in KERNEL_FLOAT_CACHES for c in kv_caches):
            caches, scales = kv_caches, []
        else:
            return False
        tables, lens = self._row_tables(meta)
        self._kernels.decode_stack_(layers, h, positions, caches, scales, meta.slot_mapping, tables, lens, self.scale,
                                    self.sliding_window or 0)
        return True

    @staticmethod
    def _row_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(block table, keys seen) of every query row: its sequence's, up to and including itself."""
        if meta.max_query_len == 1:
            return meta.block_tables, meta.seq_lens
        counts = torch.tensor(meta.query_lens_list)
        seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
        offsets = torch.arange(meta.num_tokens) - meta.query_start_loc[:-1].repeat_interleave(counts)
        return meta.block_tables.index_select(0, seq), meta.context_lens[seq] + offsets + 1

    def forward(self, q, k, v, kv_cache, meta, sinks=None):
        int8 = isinstance(kv_cache, Int8KVCache)
        if int8 and self._kernels is not None:
            k, v = k.float(), v.float()  # bf16 activations: a copy of the step's new rows only
        kernel_write = self._kernels is not None and _packed_f32(k) and _packed_f32(v)
        if kernel_write and int8:
            self._kernels.write_kv_int8_(kv_cache.data, kv_cache.scales, k, v, meta.slot_mapping)
        elif kernel_write and kv_cache.dtype in KERNEL_FLOAT_CACHES:
            self._kernels.write_kv_(kv_cache, k, v, meta.slot_mapping)
        else:
            write_kv(k, v, kv_cache, meta.slot_mapping)
        if len(self._groups) == 1:
            return self._attend(self._groups[0], q, kv_cache, sinks)
        out = torch.empty_like(q)
        for group in self._groups:
            out.index_copy_(0, group.rows, self._attend(group, q.index_select(0, group.rows), kv_cache, sinks))
        return out

    def _attend(self, group: _Group, q: torch.Tensor, kv_cache: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        if group.is_decode and self._kernels is not None:
            window = self.sliding_window or 0
            if isinstance(kv_cache, Int8KVCache):  # in float32, whatever the activations' dtype
                return self._kernels.paged_decode_attention_int8(
                    q.float(), kv_cache.data, kv_cache.scales, group.block_tables, group.seq_lens, self.scale, window,
                    sinks,
                ).to(q.dtype)
            if q.dtype == torch.float32 and kv_cache.dtype in KERNEL_FLOAT_CACHES:
                return self._kernels.paged_decode_attention(
                    q, kv_cache, group.block_tables, group.seq_lens, self.scale, window, sinks
                )
        num_seqs, max_q, max_k = group.num_seqs, group.max_q, group.max_k
        compute = torch.float32 if self._upcast and q.dtype != torch.float32 else q.dtype
        bf16_cache = getattr(kv_cache, "dtype", None) == torch.bfloat16  # an Int8KVCache has no dtype
        if self._bf16_chunks and not group.is_decode and compute == torch.float32 and bf16_cache:
            compute = torch.bfloat16
        keys, values = read_kv(kv_cache, self._key_slots(group), compute)
        keys = keys.view(num_seqs, max_k, self.num_kv_heads, self.head_dim)
        values = values.view(num_seqs, max_k, self.num_kv_heads, self.head_dim)
        if group.is_decode:
            queries = q.reshape(num_seqs, 1, self.num_heads, self.head_dim)
        else:
            padded = q.new_zeros(num_seqs * max_q, self.num_heads, self.head_dim)
            queries = padded.index_copy_(0, group.padded_rows, q).view(num_seqs, max_q, self.num_heads, self.head_dim)
        mask, is_causal = self._additive_mask(group, compute), group.is_causal
        if sinks is not None:
            keys, values, mask = self._with_sink_key(group, keys, values, sinks, compute)
            is_causal = False
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2).to(compute),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        ).transpose(1, 2).to(q.dtype)  # [n, Q, H, D]
        if group.is_decode:
            return out.reshape(num_seqs, self.num_heads, self.head_dim)
        return out.reshape(num_seqs * max_q, self.num_heads, self.head_dim).index_select(0, group.padded_rows)

    def _with_sink_key(self, group: _Group, keys, values, sinks: torch.Tensor, dtype: torch.dtype):
        """Keys and values with one more, all zeros, at the end, and the mask [n, H, Q, K + 1] that
        gives that key each head's sink as its score: its exponential joins the softmax's
        denominator while its value adds nothing, which is what a sink is."""
        n, max_q, max_k = group.num_seqs, group.max_q, group.max_k
        zeros = keys.new_zeros(n, 1, self.num_kv_heads, self.head_dim)
        keys, values = torch.cat([keys, zeros], dim=1), torch.cat([values, zeros], dim=1)
        base = group.sink_base
        if base is None or base.dtype != dtype:  # once a step, not once a layer
            if group.mask_bool is not None:
                base = self._additive_mask(group, dtype)
            elif group.is_causal or max_q > 1:
                positions = group.context_lens[:, None] + torch.arange(max_q, device=keys.device)[None, :]
                allowed = causal_mask(positions, torch.arange(max_k, device=keys.device), group.seq_lens, self.sliding_window)
                base = torch.zeros(allowed.shape, dtype=dtype, device=keys.device).masked_fill_(~allowed, float("-inf"))
                base = base.unsqueeze(1)
            else:  # one query a sequence, every key visible
                base = torch.zeros(n, 1, max_q, max_k, dtype=dtype, device=keys.device)
            group.sink_base = base = base.expand(n, self.num_heads, max_q, max_k)
        sink = sinks.to(dtype).view(1, -1, 1, 1).expand(n, self.num_heads, max_q, 1)
        return keys, values, torch.cat([base, sink], dim=-1)

    def _key_slots(self, group: _Group) -> torch.Tensor:
        # The flat cache slot of every key position each sequence attends to (padding reads slot 0,
        # which the mask then hides): exactly max_seq_len keys, not whole blocks.
        if group.key_slots is None:
            key_positions = torch.arange(group.max_k, device=group.block_tables.device)
            blocks = group.block_tables.gather(1, (key_positions // self.block_size).expand(group.num_seqs, -1))
            group.key_slots = (blocks * self.block_size + key_positions % self.block_size).reshape(-1)
        return group.key_slots

    def _additive_mask(self, group: _Group, dtype: torch.dtype) -> torch.Tensor | None:
        # SDPA would turn a boolean mask into an additive one on every call; do it once per step.
        if group.mask_bool is None:
            return None
        if group.mask is None or group.mask.dtype != dtype:
            group.mask = torch.zeros(group.mask_bool.shape, dtype=dtype, device=group.mask_bool.device)
            group.mask.masked_fill_(~group.mask_bool, float("-inf"))
        return group.mask
