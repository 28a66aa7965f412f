"""`triton`: paged attention kernels that read keys and values straight from the block table.

On CUDA it runs the Triton kernels in `cadenza.kernels.triton` (split-KV decode, prefill/extend over a
cached prefix, KV writes, bf16/fp16/fp32 and int8 caches). On the CPU it runs their torch
references, which compute the same attention with no host sync and no data-dependent shape, so
every path the GPU takes, the padded CUDA-graph decode included, also runs in the CPU tests (and
`implementation: triton` runs the kernels themselves under Triton's interpreter,
`TRITON_INTERPRET=1`, as their own tests do).

A decode step reads nothing from the host: the kernels take the step's device tensors and their
shapes only (never `seq_lens_list` or `max_seq_len`), so a decode can be captured as a CUDA graph
and replayed with other lengths (`supports_cuda_graphs`). Padding rows carry slot -1 (no write)
and sequence length 0 (a zero output).
"""

from __future__ import annotations

import os
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from cadenza.attention_backends.base import AttentionBackend, AttentionMetadata, BackendUnavailableError
from cadenza.kernels.kv_layout import Int8KVCache


class TritonOptions(BaseModel):
    """`plugin_options.triton` in a deployment YAML."""

    model_config = ConfigDict(extra="forbid")

    implementation: Literal["auto", "triton", "torch"] = Field(
        "auto", description="auto: the Triton kernels on CUDA, their torch references on the CPU. "
        "triton forces the kernels (on the CPU only under TRITON_INTERPRET=1, Triton's interpreter, "
        "slow: for testing); torch forces the references.",
    )
    max_decode_splits: int = Field(
        16, ge=1, le=64, description="Most key splits a decode row is attended in (flash-decoding): "
        "splits fill the GPU's SMs when few sequences decode.",
    )


def interpreting() -> bool:
    """Whether Triton's interpreter runs kernels on the CPU (set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonPagedBackend(AttentionBackend):
    """Writes the step's keys and values through `slot_mapping`, then one kernel per step kind:
    decode-only steps the split-KV decode kernel, any other mix the prefill/extend kernel."""

    name = "triton"
    options_model = TritonOptions
    supports_int8_kv_cache = True
    supports_cuda_graphs = True
    supports_attention_sinks = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        device = torch.device(self.device)
        choice = self.options.implementation
        if choice == "auto":
            choice = "triton" if device.type == "cuda" else "torch"
        if choice == "triton" and device.type != "cuda" and not interpreting():
            raise BackendUnavailableError(
                "attention backend 'triton' with implementation triton needs a CUDA GPU, or TRITON_INTERPRET=1 on the CPU"
            )
        self.implementation = choice
        if choice == "triton":
            from cadenza.kernels.triton import kv_cache_write, paged_attention

            self._write, self._attend = kv_cache_write, paged_attention
        else:
            from cadenza.kernels.triton import reference

            self._write = self._attend = reference
        # Splits fill the SMs: a decode of B rows over H kv heads is B * H programs per split.
        self._sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        self._leading_decodes, self._prefill_query_len = 0, 0  # this step's (begin_step)

    def begin_step(self, meta: AttentionMetadata) -> None:
        """The step's leading decode sequences (one query row each), where prefill rows follow
        them; 0 otherwise. Read from the host's query lengths once a step, not per layer."""
        lens = meta.query_lens_list
        decodes = 0
        while decodes < len(lens) and lens[decodes] == 1:
            decodes += 1
        self._leading_decodes = decodes if 0 < decodes < len(lens) else 0
        self._prefill_query_len = max(lens[decodes:]) if self._leading_decodes else 0

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        if torch.device(device).type != "cuda":
            return  # the torch references (or the interpreter) run anywhere
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailableError(
                "attention backend 'triton' needs the triton package on CUDA: pip install 'cadenza[cuda]'"
            ) from exc

    def decode_splits(self, num_seqs: int, max_blocks: int) -> int:
        """Key splits for a decode of `num_seqs` rows whose block tables are `max_blocks` wide:
        enough programs for two waves over the SMs, never more splits than blocks. Depends on
        shapes only, so a captured graph's choice holds for every replay."""
        wanted = -(-2 * self._sms // max(1, num_seqs * self.num_kv_heads))
        return max(1, min(wanted, self.options.max_decode_splits, max_blocks))

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, sinks=None):
        if isinstance(kv_cache, Int8KVCache):
            self._write.write_kv_cache_int8(k, v, kv_cache.data, kv_cache.scales, meta.slot_mapping)
            keys, values = kv_cache.data[0], kv_cache.data[1]
            scales = {"k_scales": kv_cache.scales[0], "v_scales": kv_cache.scales[1]}
        else:
            self._write.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
            keys, values, scales = kv_cache[0], kv_cache[1], {}
        window = self.sliding_window or 0
        decodes = self._leading_decodes
        if decodes and not meta.is_decode_only:
            # A mixed step's leading decode rows take the decode kernel (grouped heads, split keys)
            # rather than a prefill program a query head each: the prefill kernel runs over the
            # sequences after them (their rows are absolute indices into q), then the decodes
            # write their rows of `out`.
            out = torch.empty_like(q)
            self._attend.paged_prefill_attention(
                q, keys, values, meta.block_tables[decodes:], meta.query_start_loc[decodes:], meta.seq_lens[decodes:],
                self._prefill_query_len, self.scale, window, out=out, sinks=sinks, **scales,
            )  # fmt: skip
            splits = self.decode_splits(decodes, meta.block_tables.shape[1])
            self._attend.paged_decode_attention(
                q[:decodes], keys, values, meta.block_tables[:decodes], meta.seq_lens[:decodes], self.scale, window,
                num_splits=splits, out=out[:decodes], sinks=sinks, **scales,
            )  # fmt: skip
            return out
        if meta.is_decode_only:
            splits = self.decode_splits(q.shape[0], meta.block_tables.shape[1])
            return self._attend.paged_decode_attention(
                q, keys, values, meta.block_tables, meta.seq_lens, self.scale, window, num_splits=splits, sinks=sinks,
                **scales,
            )
        return self._attend.paged_prefill_attention(
            q, keys, values, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_query_len,
            self.scale, window, sinks=sinks, **scales,
        )  # fmt: skip
