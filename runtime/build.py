"""Builds an engine's components from a deployment config, once, at start-up: the plugins
resolved, the model shard built (with tensor-parallel ranks when asked), the sampling pipeline,
the speculator, the model runner and its decode graphs, assembled into a `Runtime`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import structlog
import torch

from cadenza.config import CadenzaConfig
from cadenza.config.errors import ConfigError
from cadenza.models.loading import LoadedModel
from cadenza.policies.eviction import EvictionPolicy
from cadenza.runner.device import resolve_device
from cadenza.runner.model_runner import ModelRunner
from cadenza.runtime.plugins import Plugins, resolve_plugins
from cadenza.runtime.registries import Registries
from cadenza.runtime.served import Served
from cadenza.runtime.shard import (
    ModelShard,
    build_draft_model,
    build_model_shard,
    runs_triton_kernels,
    set_rank_threads,
)
from cadenza.samplers.base import SamplingContext
from cadenza.samplers.extra import ExtraParams
from cadenza.samplers.pipeline import SamplingPipeline
from cadenza.speculative.setup import build_speculator
from cadenza.threads.binding import TeamPlan, plan_compute_team

log = structlog.get_logger(__name__)


@dataclass
class Runtime(Served):
    """One engine's parts, built from its config (`build_runtime`); `AsyncEngine` runs on it."""

    config: CadenzaConfig
    registries: Registries
    loaded: LoadedModel
    runner: ModelRunner
    num_blocks: int
    # A zero-argument factory: the configured policy class with its `plugin_options` bound.
    eviction_policy_cls: Callable[[], EvictionPolicy]
    extra_params: ExtraParams | None = None  # what `SamplingParams.extra` may name; for the ingress
    # Rank 0's handle on the tensor-parallel group (`parallel/launch.py`); None on one device.
    parallel: Any = None
    # Where the compute thread's team runs (`model.thread_binding`), decided at build; the engine pins it.
    team_plan: TeamPlan | None = None
    # The tiers' policy factories, by tier ("host", "disk"), as `eviction_policy_cls` for the KV budget.
    tier_policy_cls: dict[str, Callable[[], EvictionPolicy]] = field(default_factory=dict)

    def make_eviction_policy(self, tier: str | None = None) -> EvictionPolicy:
        """A new instance of the policy that orders the KV budget (`tier` None) or that tier."""
        policy = self.eviction_policy_cls() if tier is None else self.tier_policy_cls[tier]()
        policy.tier = tier
        return policy

    def failure(self) -> str | None:
        """Why the runtime can no longer run steps (a tensor-parallel rank died), or None."""
        return None if self.parallel is None else self.parallel.failure()

    def close(self) -> None:
        """Stop what the runtime started beside this process (tensor-parallel ranks); idempotent."""
        if self.parallel is not None:
            self.parallel.close()


def build_runtime(config: CadenzaConfig, extra_plugins=()) -> Runtime:
    """Everything an engine needs, built on the compute thread (see `threads/compute_thread.py`), where
    the engine's runner will later run every step."""
    from cadenza.threads import compute_thread

    return compute_thread.run_sync(_build_runtime, config, extra_plugins)


def _build_runtime(config: CadenzaConfig, extra_plugins=()) -> Runtime:
    if config.parallel.data_parallel_size > 1:
        raise ConfigError(
            "parallel.data_parallel_size: replicas are served by `cadenza serve` (cluster/replicas.py); "
            "a runtime is one engine"
        )
    if config.parallel.disaggregation.enabled:
        from cadenza.parallel.disaggregation import plan_disaggregation

        plan_disaggregation(config)  # names what does not fit (data_parallel_size, ...) first
        raise ConfigError("parallel.disaggregation: prefill and decode replicas are served by `cadenza serve` "
                          "(cluster/replicas.py); a runtime is one engine")
    plugins = resolve_plugins(config, extra_plugins)
    size = config.parallel.tensor_parallel_size
    set_rank_threads(config, size)
    if size == 1:
        return _assemble(config, plugins, build_model_shard(config, plugins), None)
    from cadenza.parallel.groups import loaded_barrier
    from cadenza.parallel.launch import start_group

    device = resolve_device(config.model.device)
    if device.type == "cpu" and config.model.cpu_kernels != "off":
        from cadenza.kernels.cpu import loader as cpu

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
    from cadenza.runner.cuda_graphs import DecodeGraphRunner

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
    if runs_triton_kernels(shard.backend):
        from cadenza.kernels.triton import sampling

        pipeline.use_one_pass(sampling)
    speculator = build_speculator(config, plugins, loaded, device, functools.partial(build_draft_model, device=device))
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
    tier_policies = {tier: functools.partial(plugins.build, cls) for tier, cls in plugins.tier_eviction_policies.items()}
    return Runtime(config, plugins.registries, loaded, runner, shard.num_blocks, eviction_policy,
                   pipeline.extra_params, parallel=group, team_plan=plan_compute_team(config, group, device),
                   tier_policy_cls=tier_policies)  # fmt: skip
