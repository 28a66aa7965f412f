"""`xformers`: memory-efficient attention on CUDA GPUs; xformers is imported only when selected."""

from __future__ import annotations

import torch

from cadenza.attention_backends.base import AttentionBackend, AttentionMetadata, BackendUnavailableError
from cadenza.kernels.kv_layout import write_kv


class XFormersBackend(AttentionBackend):
    """Gathers each sequence's keys and runs one block-diagonal causal attention over the batch."""

    name = "xformers"

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            raise BackendUnavailableError(
                "attention backend 'xformers' needs a CUDA GPU (device is "
                f"{torch.device(device).type!r}); use 'torch_sdpa' or 'eager' on CPU"
            )
        try:
            import xformers.ops  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailableError(
                "attention backend 'xformers' needs the xformers package: pip install 'cadenza[cuda]'"
            ) from exc

    def begin_step(self, meta: AttentionMetadata) -> None:
        from xformers.ops import fmha

        blocks_needed = -(-meta.max_seq_len // self.block_size)
        self._block_tables = meta.block_tables[:, :blocks_needed]
        self._max_keys = blocks_needed * self.block_size
        key_index = torch.arange(self._max_keys, device=meta.seq_lens.device)
        self._key_valid = key_index[None, :] < meta.seq_lens[:, None]
        # Queries sit at the end of their keys: "bottom-right" causal alignment with padded keys.
        self._bias = fmha.attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(
            q_seqlen=meta.query_lens_list, kv_seqlen=meta.seq_lens_list
        )
        if self.sliding_window is not None:
            self._bias = self._bias.make_local_attention_from_bottomright(self.sliding_window)

    def forward(self, q, k, v, kv_cache, meta):
        from xformers.ops import fmha

        write_kv(k, v, kv_cache, meta.slot_mapping)
        shape = (-1, self._max_keys, self.num_kv_heads, self.head_dim)
        keys = kv_cache[0][self._block_tables].view(shape)[self._key_valid]
        values = kv_cache[1][self._block_tables].view(shape)[self._key_valid]
        group = self.num_heads // self.num_kv_heads
        # xformers takes GQA as a 5-d [batch, tokens, kv_heads, group, dim] layout.
        q5 = q.view(1, -1, self.num_kv_heads, group, self.head_dim)
        k5 = keys.view(1, -1, self.num_kv_heads, 1, self.head_dim).expand(-1, -1, -1, group, -1)
        v5 = values.view(1, -1, self.num_kv_heads, 1, self.head_dim).expand(-1, -1, -1, group, -1)
        out = fmha.memory_efficient_attention_forward(q5, k5, v5, attn_bias=self._bias, scale=self.scale)
        return out.view(-1, self.num_heads, self.head_dim)
