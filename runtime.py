"""Builds an engine's components from a deployment config, once, at start-up.

Every name in the config (attention backend, sampler, logits processors, eviction policy) is
resolved here, so a typo fails before the first request with the list of known names.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from cadenza.config import CadenzaConfig
from cadenza.kv_cache import allocate_kv_caches, choose_num_blocks
from cadenza.model_runner import ModelRunner
from cadenza.models.loading import LoadedModel, load_model
from cadenza.plugins.registry import Registries, load_registries
from cadenza.samplers.base import SamplingContext
from cadenza.samplers.pipeline import SamplingPipeline

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Runtime:
    config: CadenzaConfig
    registries: Registries
    loaded: LoadedModel
    runner: ModelRunner
    num_blocks: int
    block_size: int
    eviction_policy_cls: type

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device is 'cuda' but no CUDA GPU is available; use 'cpu' or 'auto'")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    # bfloat16 by default: on CPU it halves the bytes each decode step reads, at fp32's range.
    return torch.bfloat16 if name == "auto" else _DTYPES[name]


def build_runtime(config: CadenzaConfig, extra_plugins=()) -> Runtime:
    registries = load_registries(config.plugins, extra_plugins=extra_plugins)
    backend_cls = registries.attention_backends.get(config.attention_backend)
    sampler_cls = registries.samplers.get(config.sampling.sampler)
    processor_classes = [registries.logits_processors.get(n) for n in config.sampling.logits_processors]
    eviction_cls = registries.eviction_policies.get(config.cache.eviction_policy)

    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype)
    backend_cls.check_available(device)
    if config.model.num_threads:
        torch.set_num_threads(config.model.num_threads)
    torch.manual_seed(config.model.seed)

    loaded = load_model(config.model.path, dtype=dtype, device=device, max_model_len=config.model.max_model_len)
    arch = loaded.arch
    block_size = config.cache.block_size
    num_blocks = choose_num_blocks(
        arch,
        block_size,
        dtype,
        num_blocks=config.cache.num_blocks,
        memory_budget=config.cache.memory_budget_bytes,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_model_len=loaded.max_model_len,
    )
    kv_caches = allocate_kv_caches(arch, num_blocks, block_size, dtype, device)
    backend = backend_cls(
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        scale=arch.head_dim**-0.5,
        block_size=block_size,
        sliding_window=arch.sliding_window,
        device=device,
    )
    context = SamplingContext(
        vocab_size=arch.vocab_size, eos_token_ids=loaded.tokenizer.eos_token_ids, device=device
    )
    pipeline = SamplingPipeline(context, [cls(context) for cls in processor_classes], sampler_cls(context))
    runner = ModelRunner(loaded.model, kv_caches, backend, pipeline, block_size, device)
    log.info(
        "Runtime ready",
        attention_backend=config.attention_backend,
        kv_blocks=num_blocks,
        block_size=block_size,
        device=str(device),
    )
    return Runtime(config, registries, loaded, runner, num_blocks, block_size, eviction_cls)
