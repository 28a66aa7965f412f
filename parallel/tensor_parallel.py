"""Slicing a loaded model to one rank's shard (Megatron-style), and the layers that communicate.

Each rank loads the whole checkpoint, then keeps its part (simple, and fine for models that fit
one host's memory while loading):

- q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`): column-parallel, split by output features
  (the rank's heads; its MLP columns). No communication.
- o (`o_proj`) and down (`down_proj`): row-parallel, split by input features; the partial products
  are summed by one all-reduce each (`RowParallelLinear`); the bias is added on rank 0 only.
- embedding: vocabulary-parallel; a rank looks up the ids in its rows, zeros the others, and an
  all-reduce sums the rows (`VocabParallelEmbedding`).
- LM head: vocabulary-parallel; each rank's logits for its rows are gathered on rank 0, where
  sampling happens (`VocabParallelLMHead`). A tied head keeps sharing the embedding's shard.
- norms, rotary, q/k norms: replicated.

GGUF blocks (`QuantizedLinear`) split as stored: a column-parallel split takes whole rows of
blocks; a row-parallel split cuts every row at a block boundary, which needs each rank's range of
input features to start and end on one (else that layer is de-quantized to float32, with a log
line). The fused decoder-layer kernel adds into the residual stream inside one call, with no place
for the all-reduce, so sharded layers run module by module.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

import structlog
import torch
import torch.distributed as dist
from torch import nn

from cadenza.models.config import ModelArchConfig
from cadenza.models.moe import SparseMoE
from cadenza.models.quantized_linear import (
    NATIVE_TYPES,
    PACKED_FLAG,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedTensor,
)
from cadenza.parallel.errors import ShardingError
from cadenza.parallel.groups import ParallelContext
from cadenza.parallel.partition import RankPartition, even_ranges, partition

log = structlog.get_logger(__name__)


@dataclass
class CommStats:
    """Time and bytes this process spent in collectives (for the scale-out benchmark)."""

    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.seconds, self.bytes, self.calls = 0.0, 0, 0


comm_stats = CommStats()
_stats_lock = threading.Lock()


def record(seconds: float, nbytes: int) -> None:
    with _stats_lock:
        comm_stats.seconds += seconds
        comm_stats.bytes += nbytes
        comm_stats.calls += 1


def all_reduce_sum(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """`x` summed over the group, in place where it can be. gloo sums float32 (a 16-bit tensor is
    summed in float32 and rounded back once)."""
    started = time.perf_counter()
    work = x if x.dtype == torch.float32 or x.device.type == "cuda" else x.float()
    work = work.contiguous()
    dist.all_reduce(work, group=ctx.group)
    record(time.perf_counter() - started, work.numel() * work.element_size())
    return work if work.dtype == x.dtype else work.to(x.dtype)


class RowParallelLinear(nn.Module):
    """A linear whose input features are split over the ranks: the sum of their partial products."""

    def __init__(self, inner: nn.Module, ctx: ParallelContext) -> None:
        super().__init__()
        self.inner = inner
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(self.inner(x), self.ctx)

    def linear_add_(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`residual += self(x)`: the residual is replicated, so only the product is reduced."""
        return residual.add_(self(x).to(residual.dtype))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding on this rank; the other ranks' rows arrive by all-reduce."""

    def __init__(self, inner: nn.Module, vocab: tuple[int, int], ctx: ParallelContext) -> None:
        super().__init__()
        self.inner = inner
        self.start, self.end = vocab
        self.ctx = ctx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        rows = self.inner(local.masked_fill(outside, 0))
        return all_reduce_sum(rows.masked_fill(outside.unsqueeze(-1), 0), self.ctx)


class VocabParallelLMHead(nn.Module):
    """Logits for this rank's vocabulary rows, gathered on rank 0: there [B, vocab] float32, None
    on the other ranks. Uneven shards are padded to the largest for the gather."""

    def __init__(self, inner: nn.Module, vocab: tuple[int, int], vocab_size: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.ctx = ctx
        self.shard = -(-vocab_size // ctx.world_size)  # ceil: the largest shard (`even_ranges`)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local = self.inner(hidden).float()
        started = time.perf_counter()
        if local.shape[1] < self.shard:
            local = torch.nn.functional.pad(local, (0, self.shard - local.shape[1]))
        local = local.contiguous()
        gathered = [torch.empty_like(local) for _ in range(self.ctx.world_size)] if self.ctx.is_driver else None
        dist.gather(local, gathered, dst=0, group=self.ctx.group)
        record(time.perf_counter() - started, local.numel() * local.element_size() * (self.ctx.world_size - 1))
        if gathered is None:
            return None
        return torch.cat(gathered, dim=1)[:, : self.vocab_size]


def local_arch(arch: ModelArchConfig, part: RankPartition) -> ModelArchConfig:
    """The architecture as one rank's attention and MLP see it (vocabulary stays whole: sampling
    and validation use the full one; a mixture keeps every expert, each of its share's width)."""
    local = replace(arch, num_heads=part.num_heads, num_kv_heads=part.num_kv_heads, intermediate_size=part.intermediate_size)
    if arch.moe is not None:
        e0, e1 = expert_columns(arch.moe.intermediate_size, part.world_size, part.rank)
        local = replace(local, moe=replace(arch.moe, intermediate_size=e1 - e0))
    return local


def expert_columns(width: int, world_size: int, rank: int, unit: int = 256) -> tuple[int, int]:
    """Rank `rank`'s run of each expert's intermediate columns: even runs of whole `unit`s where
    the width allows (so a quantized down projection splits on its blocks, 256 values for the
    K-quants, and stays quantized), else of columns."""
    for size in (unit, 32):
        if width % size == 0 and width // size >= world_size:
            a, b = even_ranges(width // size, world_size)[rank]
            return a * size, b * size
    return even_ranges(width, world_size)[rank]


def rank_partition(arch: ModelArchConfig, ctx: ParallelContext) -> RankPartition:
    if ctx.world_size > 1 and arch.qk_norm == "full":
        raise ShardingError(f"tensor_parallel_size {ctx.world_size}: {arch.model_type} normalises q and k over "
                            "all heads at once, which a rank's share of the heads cannot")
    return partition(
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        intermediate_size=arch.intermediate_size,
        vocab_size=arch.vocab_size,
        world_size=ctx.world_size,
        rank=ctx.rank,
    )


def max_local_kv_heads(arch: ModelArchConfig, world_size: int) -> int:
    """The most KV heads any rank holds: every rank sizes its cache by it, so all agree on the
    number of blocks without a message."""
    return max(
        rank_partition(arch, ParallelContext(r, world_size, torch.device("cpu"))).num_kv_heads for r in range(world_size)
    )


def shard_model(model: nn.Module, ctx: ParallelContext) -> RankPartition:
    """Cut a loaded `LlamaForCausalLM` (before dual precision and kernels) down to rank `ctx.rank`'s
    shard, in place; returns the partition."""
    cfg: ModelArchConfig = model.cfg
    part = rank_partition(cfg, ctx)
    layer_cfg = local_arch(cfg, part)
    hd = cfg.head_dim
    (q0, q1), (k0, k1) = part.q_heads, part.kv_heads
    qkv_rows = [(q0 * hd, q1 * hd), (cfg.q_size + k0 * hd, cfg.q_size + k1 * hd),
                (cfg.q_size + cfg.kv_size + k0 * hd, cfg.q_size + cfg.kv_size + k1 * hd)]  # fmt: skip
    i0, i1 = part.intermediate
    size = cfg.intermediate_size
    keep_bias = ctx.is_driver
    for index, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _rows(attn.qkv_proj, qkv_rows)
        attn.o_proj = RowParallelLinear(_cols(attn.o_proj, (q0 * hd, q1 * hd), keep_bias, f"layers.{index}.o_proj"), ctx)
        attn.cfg = layer.cfg = layer_cfg
        if attn.sinks is not None:  # gpt-oss: each query head's sink, with the head
            attn.sinks = _param(attn.sinks[q0:q1])
        if isinstance(mlp, SparseMoE):
            _shard_experts(mlp, cfg, ctx, keep_bias, index)
            continue
        mlp.gate_up_proj = _rows(mlp.gate_up_proj, [(i0, i1), (size + i0, size + i1)])
        mlp.down_proj = RowParallelLinear(_cols(mlp.down_proj, (i0, i1), keep_bias, f"layers.{index}.down_proj"), ctx)
        mlp.intermediate = part.intermediate_size
    tied = cfg.tie_word_embeddings
    embedding = _embedding_rows(model.embed_tokens, part.vocab)
    if tied and isinstance(embedding, QuantizedEmbedding):
        head = QuantizedLinear.tied_to(embedding)
    elif tied:
        head = nn.Linear(cfg.hidden_size, embedding.num_embeddings, bias=False, device="meta")
        head.weight = embedding.weight
    else:
        head = _rows(model.lm_head, [part.vocab])
    model.embed_tokens = VocabParallelEmbedding(embedding, part.vocab, ctx)
    model.lm_head = VocabParallelLMHead(head, part.vocab, cfg.vocab_size, ctx)
    return part


def _shard_experts(moe: SparseMoE, cfg: ModelArchConfig, ctx: ParallelContext, keep_bias: bool, index: int) -> None:
    """Every expert cut as a dense MLP is (its gate/up rows and down columns of this rank's run of
    the experts' width; the down biases on the driver only); the router stays whole, so every rank
    routes alike, and the mixture's partial output is summed over the ranks once a layer."""
    width = cfg.moe.intermediate_size
    e0, e1 = expert_columns(width, ctx.world_size, ctx.rank)
    for j, expert in enumerate(moe.experts):
        expert.gate_up_proj = _rows(expert.gate_up_proj, [(e0, e1), (width + e0, width + e1)])
        expert.down_proj = _cols(expert.down_proj, (e0, e1), keep_bias, f"layers.{index}.experts.{j}.down_proj")
        expert.intermediate = e1 - e0
    moe.reduce = lambda partial: all_reduce_sum(partial, ctx)


# --- slicing each kind of module ------------------------------------------------------------------


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = _param(weight)
    if bias is not None:
        linear.bias = _param(bias)
    return linear


def _file_layout(module: QuantizedLinear) -> None:
    if any(qtype & PACKED_FLAG for _, qtype in module.parts):
        raise ValueError("shard a quantized linear before use_cpu_kernels: its blocks are packed for the kernels")


def _rows(module: nn.Module, ranges: list[tuple[int, int]]) -> nn.Module:
    """Output rows `ranges` of a linear, one after another (column-parallel)."""
    bias = None if module.bias is None else torch.cat([module.bias[a:b] for a, b in ranges])
    if isinstance(module, QuantizedLinear):
        _file_layout(module)
        out = QuantizedLinear(module.in_features, sum(b - a for a, b in ranges), bias is not None)
        row = 0
        for a, b in ranges:
            for i, (first, qtype) in enumerate(module.parts):
                blocks = module._blocks(i)
                lo, hi = max(a, first), min(b, first + blocks.shape[0])
                if lo < hi:
                    out.load_rows(row + lo - a, QuantizedTensor(blocks[lo - first : hi - first].clone(), qtype, module.in_features))
            row += b - a
        out.finish_loading()
        if bias is not None:
            out.bias = _param(bias)
        return out
    return _linear(torch.cat([module.weight[a:b] for a, b in ranges]), bias)


def _cols(module: nn.Module, cols: tuple[int, int], keep_bias: bool, name: str) -> nn.Module:
    """Input features [a, b) of a linear (row-parallel); the bias only where `keep_bias`."""
    a, b = cols
    bias = module.bias if keep_bias else None
    if not isinstance(module, QuantizedLinear):
        return _linear(module.weight[:, a:b], bias)
    _file_layout(module)
    misaligned = [NATIVE_TYPES[q][0] for _, q in module.parts if a % NATIVE_TYPES[q][1] or b % NATIVE_TYPES[q][1]]
    if misaligned:
        log.info(
            "De-quantizing a row-parallel layer: its split does not fall on block boundaries",
            layer=name, input_features=(a, b), block_types=sorted(set(misaligned)),
        )  # fmt: skip
        return _linear(_dequantize(module)[:, a:b], bias)
    out = QuantizedLinear(b - a, module.out_features, bias is not None)
    for i, (first, qtype) in enumerate(module.parts):
        _, values, nbytes = NATIVE_TYPES[qtype]
        blocks = module._blocks(i)[:, a // values * nbytes : b // values * nbytes]
        out.load_rows(first, QuantizedTensor(blocks.clone(), qtype, b - a))
    out.finish_loading()
    if bias is not None:
        out.bias = _param(bias)
    return out


def _dequantize(module: QuantizedLinear) -> torch.Tensor:
    from cadenza.kernels.cpu import loader as cpu

    kernels = cpu.configure("auto")
    weight = torch.empty(module.out_features, module.in_features)
    for i, (first, qtype) in enumerate(module.parts):
        blocks = module._blocks(i)
        kernels.quant_dequantize_(weight.narrow(0, first, blocks.shape[0]), blocks, qtype)
    return weight


def _embedding_rows(module: nn.Module, vocab: tuple[int, int]) -> nn.Module:
    v0, v1 = vocab
    if isinstance(module, QuantizedEmbedding):
        out = QuantizedEmbedding(v1 - v0, module.embedding_dim)
        out.load_rows(0, QuantizedTensor(module.blocks[v0:v1].clone(), module.qtype, module.embedding_dim))
        return out
    out = nn.Embedding(v1 - v0, module.embedding_dim, _weight=torch.empty(v1 - v0, module.embedding_dim, device="meta"))
    out.weight = _param(module.weight[v0:v1])
    return out
