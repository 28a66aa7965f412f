"""Builds an engine's components from a deployment config, once, at start-up.

Every name in the config (attention backend, sampler, logits processors, eviction policy) and every
`plugin_options` entry is resolved here, so a typo fails before the first request with the list of
known names, and a bad option with its key path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import structlog
import torch
from pydantic import BaseModel, ValidationError

from cadenza.config import CadenzaConfig
from cadenza.config.errors import ConfigError, key_path
from cadenza.kv_cache import allocate_kv_caches, available_memory, size_cache
from cadenza.model_runner import ModelRunner
from cadenza.models.loading import LoadedModel, load_model
from cadenza.plugins.eviction import EvictionPolicy
from cadenza.plugins.registry import Registries, load_registries
from cadenza.samplers.base import SamplingContext
from cadenza.samplers.extra import ExtraParams
from cadenza.samplers.pipeline import SamplingPipeline
from cadenza.speculative.setup import build_speculator, proposer_classes
from cadenza.thread_binding import TeamPlan, plan_compute_team

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Plugins:
    """The classes a config names, and the validated `plugin_options` of each (None: no options)."""

    registries: Registries
    attention_backend: type
    sampler: type
    logits_processors: list[type]
    eviction_policy: type
    options: dict[str, BaseModel | None]

    def build(self, cls: type, *args: Any, **kwargs: Any) -> Any:
        """`cls(*args, **kwargs)`, with `options=` when the class takes options."""
        if cls.options_model is not None:
            kwargs["options"] = self.options.get(cls.name)
        return cls(*args, **kwargs)


def attention_backend_name(config: CadenzaConfig) -> str:
    """The backend `attention_backend` names; auto: triton on CUDA, torch_sdpa on the CPU."""
    if config.attention_backend != "auto":
        return config.attention_backend
    return "triton" if resolve_device(config.model.device).type == "cuda" else "torch_sdpa"


def resolve_plugins(config: CadenzaConfig, extra_plugins: Iterable[object] = ()) -> Plugins:
    """Load plugins, resolve the config's names and validate `plugin_options`; loads no model."""
    registries = load_registries(config.plugins, extra_plugins=extra_plugins)
    plugins = Plugins(
        registries,
        attention_backend=registries.attention_backends.get(attention_backend_name(config)),
        sampler=registries.samplers.get(config.sampling.sampler),
        logits_processors=[registries.logits_processors.get(n) for n in config.sampling.logits_processors],
        eviction_policy=registries.eviction_policies.get(config.cache.eviction_policy),
        options={},
    )
    configured = [plugins.attention_backend, plugins.sampler, *plugins.logits_processors, plugins.eviction_policy]
    # The deployment's default context policy and providers (the sessions' own picks are checked as they make them).
    configured.append(registries.context_policies.get(config.sessions.context_policy))
    configured += [registries.context_providers.get(name) for name in config.sessions.context_providers]
    configured += proposer_classes(config, registries)
    # The KV connector's name and options (prefill/decode disaggregation; parallel/disaggregation.py).
    configured.append(registries.kv_connectors.get(config.parallel.disaggregation.connector))
    plugins.options = _validate_options(config.plugin_options, registries, configured)
    return plugins


def _validate_options(given: dict[str, dict[str, Any]], registries: Registries, configured: list[type]) -> dict[str, BaseModel | None]:
    registered = {
        name: registry.get(name)
        for registry in (registries.attention_backends, registries.samplers, registries.logits_processors,
                         registries.eviction_policies, registries.context_policies, registries.context_providers,
                         registries.proposers, registries.kv_connectors)
        for name in registry.names()
    }
    problems = []
    for name in given:
        cls = registered.get(name)
        if cls is None:
            problems.append(f"plugin_options.{name}: no plugin registers {name!r}; registered: {', '.join(sorted(registered))}")
        elif cls.options_model is None:
            problems.append(f"plugin_options.{name}: {name!r} takes no options")
    options: dict[str, BaseModel | None] = {}
    for cls in configured:
        if cls.options_model is None:
            continue
        try:
            options[cls.name] = cls.options_model.model_validate(given.get(cls.name, {}))
        except ValidationError as exc:
            problems += [
                f"{key_path(('plugin_options', cls.name, *err['loc']))}: {err['msg']}" for err in exc.errors(include_url=False)
            ]
    if problems:
        raise ConfigError(problems)
    return options


@dataclass
class Runtime:
    config: CadenzaConfig
    registries: Registries
    loaded: LoadedModel
    runner: ModelRunner
    num_blocks: int
    block_size: int
    # A zero-argument factory: the configured policy class with its `plugin_options` bound.
    eviction_policy_cls: Callable[[], EvictionPolicy]
    extra_params: ExtraParams | None = None  # what `SamplingParams.extra` may name; for the ingress
    # Rank 0's handle on the tensor-parallel group (`parallel/launch.py`); None on one device.
    parallel: Any = None
    # Where the compute thread's team runs (`model.thread_binding`), decided at build; the engine pins it.
    team_plan: TeamPlan | None = None

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    def make_eviction_policy(self) -> EvictionPolicy:
        return self.eviction_policy_cls()

    def failure(self) -> str | None:
        """Why the runtime can no longer run steps (a tensor-parallel rank died), or None."""
        return None if self.parallel is None else self.parallel.failure()

    def close(self) -> None:
        """Stop what the runtime started beside this process (tensor-parallel ranks); idempotent."""
        if self.parallel is not None:
            self.parallel.close()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device is 'cuda' but no CUDA GPU is available; use 'cpu' or 'auto'")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    # bfloat16 by default: on CPU it halves the bytes each decode step reads, at fp32's range.
    return torch.bfloat16 if name == "auto" else _DTYPES[name]


def resolve_kv_dtype(name: str, compute_dtype: torch.dtype, int8_activations: bool = False) -> torch.dtype:
    """`cache.dtype` as a torch dtype; torch.int8 is the quantized cache (see `kv_cache.py`).

    auto: bfloat16 wherever attention computes in bfloat16, and also where the linears round their
    activations to int8 (block-quantized weights, `int8_activations`: a GGUF's, or
    `quantization: int8`), whose error bfloat16 keys and values stay far below (~2^-9 of a value
    against int8's ~2^-8 of a block's largest); the CPU decode kernels read 16-bit rows widened to
    float32 at float32's speed. Half float32's bytes, as llama.cpp's default f16 cache. Otherwise
    the dtype attention computes in: float32 attention over float weights stays exact to the
    reference (transformers in float32)."""
    if name == "auto":
        if compute_dtype == torch.float32 and int8_activations:
            return torch.bfloat16
        return compute_dtype
    return torch.int8 if name == "int8" else _DTYPES[name]


# The caches the CPU decode kernels read in place (besides int8): float32 and 16-bit rows.
KERNEL_FLOAT_CACHES = (torch.float32, torch.bfloat16, torch.float16)


def _attention_kernels(config: CadenzaConfig, loaded: LoadedModel, kv_dtype: torch.dtype, device: torch.device):
    """The CPU kernels for the attention backend, or None: the model's, for float32 activations
    over a float32 or 16-bit cache; for an int8 cache, whatever the activations (its decode reads
    it in float32)."""
    if kv_dtype == torch.int8 and device.type == "cpu":
        from cadenza.kernels import cpu

        return loaded.model.kernels or cpu.configure(config.model.cpu_kernels)
    return loaded.model.kernels if loaded.compute_dtype == torch.float32 and kv_dtype in KERNEL_FLOAT_CACHES else None


def build_runtime(config: CadenzaConfig, extra_plugins=()) -> Runtime:
    """Everything an engine needs, built on the compute thread (see `compute_thread.py`), where
    the engine's runner will later run every step."""
    from cadenza import compute_thread

    return compute_thread.run_sync(_build_runtime, config, extra_plugins)


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
                        transform=transform, load_format=config.model.load_format, seed=config.model.seed)  # fmt: skip
    arch = cache_arch = loaded.arch
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
    backend = plugins.build(
        backend_cls,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        scale=arch.head_dim**-0.5,
        block_size=block_size,
        sliding_window=arch.sliding_window,
        device=device,
    )
    backend.use_cpu_kernels(_attention_kernels(config, loaded, kv_dtype, device))
    return ModelShard(loaded, loaded.model, kv_caches, backend, num_blocks, kv_dtype)


def _build_runtime(config: CadenzaConfig, extra_plugins=()) -> Runtime:
    if config.parallel.data_parallel_size > 1:
        raise ConfigError(
            "parallel.data_parallel_size: replicas are served by `cadenza serve` (parallel/replicas.py); "
            "a runtime is one engine"
        )
    if config.parallel.disaggregation.enabled:
        from cadenza.parallel.disaggregation import plan_disaggregation

        plan_disaggregation(config)  # names what does not fit (data_parallel_size, ...) first
        raise ConfigError("parallel.disaggregation: prefill and decode replicas are served by `cadenza serve` "
                          "(parallel/replicas.py); a runtime is one engine")
    plugins = resolve_plugins(config, extra_plugins)
    size = config.parallel.tensor_parallel_size
    set_rank_threads(config, size)
    if size == 1:
        return _assemble(config, plugins, build_model_shard(config, plugins), None)
    from cadenza.parallel.groups import loaded_barrier
    from cadenza.parallel.launch import start_group

    device = resolve_device(config.model.device)
    if device.type == "cpu" and config.model.cpu_kernels != "off":
        from cadenza.kernels import cpu

        cpu.configure(config.model.cpu_kernels)  # built (or found cached) once, before the ranks load
    group = start_group(config, device)
    try:
        shard = build_model_shard(config, plugins, group.ctx)
        loaded_barrier(group.ctx)  # every rank has its shard
        shard.model = group.wrap(shard.model, config.parallel.timeout_seconds)
        return _assemble(config, plugins, shard, group)
    except BaseException:
        group.close()
        raise


def build_decode_graphs(config: CadenzaConfig, shard: ModelShard, runner: ModelRunner, group):
    """The decode-graph runner `model.cuda_graphs` asks for, its graphs captured; or None."""
    from cadenza.cuda_graphs import DecodeGraphRunner

    mode, device = config.model.cuda_graphs, shard.loaded.device
    able = getattr(shard.backend, "supports_cuda_graphs", False)
    if mode == "off" or (mode == "auto" and (device.type != "cuda" or not able or group is not None)):
        return None
    if not able:
        raise ConfigError(f"model.cuda_graphs on: attention backend {shard.backend.name!r} cannot pad decode steps; "
                          "use 'triton' or set model.cuda_graphs to auto or off")
    if group is not None:
        raise ConfigError("model.cuda_graphs on: not with tensor parallelism (its collectives run on the host); use auto")
    # Wide enough for any sequence's table: its longest length plus a speculative step's guesses.
    longest = shard.loaded.max_model_len + config.speculative.num_tokens
    graphs = DecodeGraphRunner(shard.model, shard.backend, shard.kv_caches, runner._packer,
                               max_num_seqs=config.scheduler.max_num_seqs, table_width=-(-longest // config.cache.block_size),
                               capture=device.type == "cuda")  # fmt: skip
    graphs.capture_all()
    return graphs


def build_sampling_pipeline(plugins: Plugins, vocab_size: int, tokenizer, device: torch.device) -> SamplingPipeline:
    context = SamplingContext(vocab_size=vocab_size, eos_token_ids=tokenizer.eos_token_ids, device=device, tokenizer=tokenizer)
    return SamplingPipeline(
        context, [plugins.build(cls, context) for cls in plugins.logits_processors], plugins.build(plugins.sampler, context)
    )


def _assemble(config: CadenzaConfig, plugins: Plugins, shard: ModelShard, group) -> Runtime:
    loaded, device = shard.loaded, shard.loaded.device
    block_size = config.cache.block_size
    pipeline = build_sampling_pipeline(plugins, loaded.arch.vocab_size, loaded.tokenizer, device)
    speculator = build_speculator(config, plugins, loaded, device)
    runner = ModelRunner(shard.model, shard.kv_caches, shard.backend, pipeline, block_size, device, speculator=speculator)
    runner.graphs = build_decode_graphs(config, shard, runner, group)
    log.info(
        "Runtime ready",
        attention_backend=shard.backend.name,
        cuda_graphs=None if runner.graphs is None else ("captured" if runner.graphs.capture else "padded, eager"),
        kv_blocks=shard.num_blocks,
        kv_dtype=str(shard.kv_dtype).removeprefix("torch."),
        kv_capacity_tokens=shard.num_blocks * block_size,
        block_size=block_size,
        device=str(device),
        tensor_parallel_size=config.parallel.tensor_parallel_size,
    )
    eviction_policy = functools.partial(plugins.build, plugins.eviction_policy)
    return Runtime(config, plugins.registries, loaded, runner, shard.num_blocks, block_size, eviction_policy,
                   pipeline.extra_params, parallel=group, team_plan=plan_compute_team(config, group, device))  # fmt: skip
