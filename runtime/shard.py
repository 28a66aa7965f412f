"""Building a model shard: what one rank computes with (the whole model without tensor
parallelism), its KV cache sized and allocated, and the attention backend over it."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import structlog
import torch

from cadenza.config import CadenzaConfig
from cadenza.config.errors import ConfigError
from cadenza.kernels.kv_layout import KERNEL_FLOAT_CACHES
from cadenza.models.errors import ModelLoadError
from cadenza.models.loading import LoadedModel, load_model
from cadenza.runner.device import resolve_device, resolve_dtype, resolve_kv_dtype
from cadenza.runner.kv_cache import allocate_kv_caches, available_memory, size_cache
from cadenza.runtime.plugins import Plugins
from cadenza.speculative.base import DraftModel

log = structlog.get_logger(__name__)


@dataclass
class ModelShard:
    """What one rank computes with: its model (the whole one without tensor parallelism), the KV
    cache for its heads, and the attention backend over them."""

    loaded: LoadedModel
    model: torch.nn.Module
    kv_caches: list
    backend: Any
    num_blocks: int
    kv_dtype: torch.dtype


def set_rank_threads(config: CadenzaConfig, world_size: int = 1) -> None:
    """torch's intra-op threads: `model.num_threads`, else the cores shared by the ranks on this
    machine (two ranks of two threads on two cores would fight over them)."""
    import os

    if config.model.num_threads:
        torch.set_num_threads(config.model.num_threads)
    elif world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def build_model_shard(config: CadenzaConfig, plugins: Plugins, ctx=None) -> ModelShard:
    """Load the model (cut to rank `ctx.rank`'s shard when `ctx`, a tensor-parallel
    `ParallelContext`, is given), size and allocate its KV cache, build the attention backend."""
    backend_cls = plugins.attention_backend
    device = ctx.device if ctx is not None else resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype)
    backend_cls.check_available(device)
    if config.cache.dtype == "int8" and not backend_cls.supports_int8_kv_cache:
        raise ConfigError(f"cache.dtype: attention backend {backend_cls.name!r} cannot read an int8 KV cache")
    torch.manual_seed(config.model.seed)
    transform = None
    if ctx is not None:
        from cadenza.parallel.tensor_parallel import shard_model

        transform = functools.partial(shard_model, ctx=ctx)
    loaded = load_model(config.model.path, dtype=dtype, device=device, max_model_len=config.model.max_model_len,
                        cpu_kernels=config.model.cpu_kernels, quantization=config.model.quantization,
                        transform=transform, load_format=config.model.load_format, seed=config.model.seed,
                        moe_experts_on=config.model.moe_experts_on)  # fmt: skip
    arch = cache_arch = loaded.arch
    if arch.attention_sinks and not backend_cls.supports_attention_sinks:
        raise ConfigError(f"attention_backend: {backend_cls.name!r} has no attention sinks, which "
                          f"{arch.model_type} needs; torch_sdpa and eager have them")
    if ctx is not None:
        from cadenza.parallel.tensor_parallel import local_arch, max_local_kv_heads, rank_partition

        arch = local_arch(loaded.arch, rank_partition(loaded.arch, ctx))
        # Every rank sizes its cache alike, so all agree on the block count without a message.
        cache_arch = replace(arch, num_kv_heads=max_local_kv_heads(loaded.arch, ctx.world_size))
    block_size = config.cache.block_size
    # By default 16-bit wherever that costs nothing the model does not already round away (see resolve_kv_dtype).
    kv_dtype = resolve_kv_dtype(config.cache.dtype, loaded.compute_dtype, loaded.quantized_weights > 0)
    sized = size_cache(
        cache_arch,
        block_size,
        kv_dtype,
        num_blocks=config.cache.num_blocks,
        memory_budget=config.cache.memory_budget_bytes,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_model_len=loaded.max_model_len,
        available=available_memory(device),
    )
    num_blocks = sized.num_blocks
    log.info("KV cache sized", kv_bytes=sized.nbytes, kv_mib=round(sized.nbytes / 2**20, 1), kv_blocks=num_blocks,
             kv_tokens=num_blocks * block_size, kv_dtype=str(kv_dtype).removeprefix("torch."), why=sized.reason)
    kv_caches = allocate_kv_caches(arch, num_blocks, block_size, kv_dtype, device)
    def build(window: int | None):
        backend = plugins.build(backend_cls, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                                head_dim=arch.head_dim, scale=arch.softmax_scale, block_size=block_size,
                                sliding_window=window, device=device)  # fmt: skip
        backend.use_cpu_kernels(_attention_kernels(config, loaded, kv_dtype, device))
        return backend

    backend = build(arch.sliding_window)
    if arch.layer_windows is not None:  # layers with a window of their own (Gemma 3) attend through a second one
        loaded.model.use_windowed_backend(build(layer_window(arch)))
    if runs_triton_kernels(backend) and hasattr(loaded.model, "use_layer_ops") and getattr(loaded.model, "kernels", None) is None:
        # Where the Triton attention kernels run (CUDA, or the interpreter), the layer's
        # elementwise work runs on Triton kernels too: a launch each instead of torch's several.
        from cadenza.kernels.triton import layer_ops

        loaded.model.use_layer_ops(layer_ops)
    return ModelShard(loaded, loaded.model, kv_caches, backend, num_blocks, kv_dtype)


def runs_triton_kernels(backend) -> bool:
    """Whether the attention backend runs Triton's kernels themselves (on CUDA, or under Triton's
    interpreter): the model's layer ops and the one-pass sampler then run on Triton too."""
    return getattr(backend, "implementation", None) == "triton"


def layer_window(arch) -> int:
    """The one sliding window of the layers that have one (where layers differ in theirs)."""
    windows = {w for w in arch.layer_windows if w is not None}
    if len(windows) != 1:
        raise ModelLoadError(f"{arch.model_type}: layers with {len(windows)} different sliding windows "
                             f"({sorted(windows)}); one window besides full attention is supported")
    return windows.pop()


def _attention_kernels(config: CadenzaConfig, loaded: LoadedModel, kv_dtype: torch.dtype, device: torch.device):
    """The CPU kernels for the attention backend, or None: the model's, for float32 activations
    over a float32 or 16-bit cache; for an int8 cache, whatever the activations (its decode reads
    it in float32)."""
    if kv_dtype == torch.int8 and device.type == "cpu":
        from cadenza.kernels.cpu import loader as cpu

        return loaded.model.kernels or cpu.configure(config.model.cpu_kernels)
    return loaded.model.kernels if loaded.compute_dtype == torch.float32 and kv_dtype in KERNEL_FLOAT_CACHES else None


def build_draft_model(*, path: str | None, dtype: str, quantization: str, max_model_len: int, num_slots: int,
                      block_size: int, eos_token_ids: tuple[int, ...], device: torch.device) -> DraftModel:  # fmt: skip
    """A draft model for speculative decoding (`ProposerContext.load_draft`): loaded beside the
    target, with a cache of `num_slots` runs of blocks, each long enough for its whole context,
    `torch_sdpa` attention and a greedy sampler."""
    from cadenza.attention_backends.torch_sdpa import TorchSDPABackend
    from cadenza.runner.model_runner import ModelRunner
    from cadenza.samplers.base import SamplingContext
    from cadenza.samplers.default_sampler import DefaultSampler
    from cadenza.samplers.pipeline import SamplingPipeline

    loaded = load_model(path, dtype=resolve_dtype(dtype), device=device, max_model_len=max_model_len,
                        cpu_kernels="auto", quantization=quantization)  # fmt: skip
    arch = loaded.arch
    blocks_per_slot = -(-loaded.max_model_len // block_size)
    caches = allocate_kv_caches(arch, num_slots * blocks_per_slot, block_size, loaded.compute_dtype, device)
    def build(window: int | None) -> TorchSDPABackend:
        backend = TorchSDPABackend(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                                   scale=arch.softmax_scale, block_size=block_size, sliding_window=window,
                                   device=device)  # fmt: skip
        if loaded.compute_dtype == torch.float32:
            backend.use_cpu_kernels(loaded.model.kernels)
        return backend

    backend = build(arch.sliding_window)
    if arch.layer_windows is not None:
        loaded.model.use_windowed_backend(build(layer_window(arch)))
    sampling = SamplingContext(vocab_size=arch.vocab_size, eos_token_ids=eos_token_ids, device=device)
    runner = ModelRunner(loaded.model, caches, backend, SamplingPipeline(sampling, [], DefaultSampler(sampling)),
                         block_size, device)  # fmt: skip
    return DraftModel(runner, arch.vocab_size, loaded.max_model_len, blocks_per_slot, str(loaded.source))
