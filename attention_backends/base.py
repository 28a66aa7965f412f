"""The attention backend contract: attention over a paged KV cache for a mixed batch.

A step's tokens are flattened: sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`.
Those are its newest `query_lens[i]` tokens, at positions `context_lens[i] .. seq_lens[i] - 1`; the
first `context_lens[i]` tokens (an earlier chunk, a cached prefix, or the tokens before a decode
step) are already in the cache. One batch may mix prefills, chunked prefills and decodes.

KV cache layout per layer: a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]; token t of
sequence i lives in block `block_tables[i, t // block_size]` at offset `t % block_size`. The new
tokens' keys and values are written to the flat slots `slot_mapping` (block * block_size + offset).
With `cache.dtype: int8` a layer's cache is an `Int8KVCache` instead (the same layout in int8, and
a scale per slot and kv head), given only to a backend class that sets `supports_int8_kv_cache = True`
(the built-in `torch_sdpa` and `eager` do; `write_kv` and `read_kv` in kernels/kv_layout.py handle both
kinds).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import BaseModel


class BackendUnavailableError(RuntimeError):
    """The selected attention backend cannot run here (missing package or device)."""


@dataclass(slots=True)
class AttentionMetadata:
    """What every layer's attention needs for one step. Built once per step by the runner."""

    query_start_loc: torch.Tensor  # [B + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int64, tokens in the cache after this step
    context_lens: torch.Tensor  # [B] int64, tokens in the cache before this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    query_lens_list: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """One instance per model, shared by all layers.

    `begin_step(meta)` runs once per step before the first layer (derive masks and gather indices
    there, not per layer); `forward` runs per layer: it must store the new keys and values through
    `meta.slot_mapping`, then attend each query row to its sequence's keys at positions
    `<= its own position` (and within `sliding_window` when set). A backend with an
    `options_model` also gets `options=` from the config's `plugin_options[name]`.
    """

    name: ClassVar[str]
    options_model: ClassVar[type[BaseModel] | None] = None
    # Whether `forward` can take an `Int8KVCache` (cache.dtype int8); a deployment that asks for
    # one with a backend that cannot is refused at start-up.
    supports_int8_kv_cache: ClassVar[bool] = False
    # Whether a decode step may be padded to a batch-size bucket and replayed as a CUDA graph
    # (runner/cuda_graphs.py): its decode path reads only device tensors and their shapes, never
    # `seq_lens_list` or `max_seq_len` (a captured graph replays with other lengths), skips
    # the KV write of a slot -1 (padding), gives a finite output for a sequence length of 0, and
    # takes block tables of any strides (column-major there) whose entries past a row's last
    # block are stale: only a row's blocks below its length may be dereferenced.
    supports_cuda_graphs: ClassVar[bool] = False
    # Whether `forward` takes `sinks=` (gpt-oss): a float32 logit per query head [num_heads] that
    # joins each query's softmax denominator with no value behind it, i.e. the output is scaled
    # by sum(e^s) / (sum(e^s) + e^sink) over the scores s the query sees. A model with sinks is
    # refused at start-up by a backend that does not set this; others are never passed `sinks`.
    supports_attention_sinks: ClassVar[bool] = False

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        block_size: int,
        sliding_window: int | None = None,
        device: torch.device = torch.device("cpu"),
        options: BaseModel | None = None,
    ) -> None:
        self.check_available(device)
        if options is None and self.options_model is not None:
            options = self.options_model()
        self.options = options
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        """Raise `BackendUnavailableError` naming what is missing; the default runs anywhere."""

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Prepare per-step state shared by all layers."""

    def use_cpu_kernels(self, kernels) -> None:
        """Called once at start-up with cadenza's compiled CPU kernels (`cadenza.kernels.cpu.loader`), or
        None where they are off or unavailable. A backend may use them; the default ignores them."""

    def run_decode_stack(self, layers: list, h: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata) -> bool:
        """Run a step of few rows (the model decides how few) through every layer in one kernel
        call, if this backend can: `layers` are the model's `DecoderLayerKernel`s
        (kernels/cpu/decode_layer.h), `h` [T, hidden] float32 the residual stream, updated in place.
        Returns False (having done nothing) where it cannot; the model then calls `forward` layer
        by layer. Its attention must be what `forward` computes, to rounding. The default cannot."""
        return False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [num_heads] float32; only where supports_attention_sinks
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


def causal_mask(
    query_positions: torch.Tensor,  # [..., Q] absolute positions of the queries
    key_positions: torch.Tensor,  # [K]
    seq_lens: torch.Tensor,  # [...] valid keys per sequence
    sliding_window: int | None,
) -> torch.Tensor:
    """Boolean [..., Q, K]: True where a query may attend to a key."""
    qp = query_positions.unsqueeze(-1)
    kp = key_positions
    allowed = (kp <= qp) & (kp < seq_lens[..., None, None])
    if sliding_window is not None:
        allowed &= kp > qp - sliding_window
    return allowed
