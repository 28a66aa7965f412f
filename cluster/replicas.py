"""Data parallelism: N engine replicas (processes) behind one server port, started and stopped.

The server process loads no model: `start_replicas` checks the deployment's shape
(`placement.py`), starts the replicas (`replica_server.py`), each a `ManagedProcess`
(`lifecycle.py`), and returns a `ReplicaFrontEnd` (tokenizer, limits, plugins: what the API layer
reads). The app then serves a `DataParallelEngine` (`dp_engine.py`), which has `AsyncEngine`'s
interface. `ReplicaFrontEnd.close` stops the replicas (and a Ray instance cadenza started), and a
local one also dies with its parent, so none outlives its server.

A replica with `tensor_parallel_size` > 1 starts its own tensor-parallel group (its ranks, its
MASTER_PORT); locally on CUDA it sees only its own GPUs. `launcher: ray` (the `cadenza[ray]` extra)
starts each replica under a Ray actor instead (`ray_replicas.py`); see docs/scale-out.md.

With `parallel.disaggregation` the replicas are prefill and decode replicas (`disaggregation.py`,
checked before anything starts): this process hosts the store their KV connectors meet in, each
replica joins the others before it reports ready, and the app serves a `DisaggregatedEngine`
(`pd_engine.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import structlog

from cadenza.cluster.dp_engine import DataParallelEngine
from cadenza.cluster.kv_transfer import peer_flag
from cadenza.cluster.replica_server import READY, replica_command
from cadenza.config import CadenzaConfig
from cadenza.parallel.disaggregation import Roles, check_connector, plan_disaggregation
from cadenza.parallel.errors import ReplicaFailedError
from cadenza.parallel.lifecycle import LocalProcess, ManagedProcess
from cadenza.parallel.placement import ReplicaShape, plan_replicas, visible_devices
from cadenza.runtime.served import Served

log = structlog.get_logger(__name__)

START_SECONDS = 300.0  # loading a model in a fresh process on a busy machine
STOP_SECONDS = 10.0


@dataclass
class ReplicaFrontEnd(Served):
    """What a server whose engines are replicas serves: their tokenizer, limits and processes."""

    config: CadenzaConfig
    registries: Any
    loaded: Any  # .arch, .tokenizer, .max_model_len
    replicas: list[ManagedProcess]  # each has its `address` once ready
    extra_params: Any = None
    num_blocks: int = 0
    on_close: Callable[[], None] | None = None  # what else the launcher tears down (a Ray instance)
    closed: bool = field(default=False)
    roles: Roles | None = None  # which replicas prefill and which decode, when disaggregated

    def serve_engine(self, **kwargs):
        """The engine over the replicas (`AsyncEngine.serve`'s keywords): data-parallel, or
        prefill/decode disaggregated when the replicas have roles."""
        if self.roles is not None:
            from cadenza.cluster.pd_engine import DisaggregatedEngine

            return DisaggregatedEngine.serve(self, **kwargs)
        return DataParallelEngine.serve(self, **kwargs)

    def failure(self) -> str | None:
        """Why a replica that will not come back by itself stopped, or None."""
        if self.closed:
            return None
        return next((r.failure() for r in self.replicas if not r.restarts and r.failure()), None)

    def close(self) -> None:
        """Stop every replica, then whatever the launcher started; idempotent."""
        if self.closed:
            return
        self.closed = True
        for replica in self.replicas:
            try:
                replica.stop(STOP_SECONDS)
            except Exception as exc:  # one that cannot be stopped must not keep the others running
                log.warning("Could not stop a replica", replica=replica.name, error=repr(exc))
        if self.on_close is not None:
            self.on_close()
        log.info("Data-parallel replicas stopped", replicas=len(self.replicas))


def start_replicas(config: CadenzaConfig) -> ReplicaFrontEnd:
    """Start `parallel.data_parallel_size` replicas, each of `tensor_parallel_size` ranks, and wait
    until each listens. The shape is checked first (`ConfigError` when it does not fit)."""
    from cadenza.models.loading import load_tokenizer
    from cadenza.runtime.build import build_sampling_pipeline
    from cadenza.runtime.plugins import resolve_plugins

    plugins = resolve_plugins(config)
    roles = plan_disaggregation(config)
    if roles is not None:
        check_connector(config, plugins.registries)  # a missing package fails here, not in every replica
    if config.parallel.launcher == "ray":
        from cadenza.cluster.ray_replicas import start_ray_replicas

        replicas, on_close = start_ray_replicas(config, lambda shape: _one_replica(config, shape),
                                                kv_world=None if roles is None else roles.world_size)
    else:
        replicas, on_close = _start_local(config, roles)
    try:
        arch, tokenizer, max_model_len = load_tokenizer(config.model.path, config.model.max_model_len)
        pipeline = build_sampling_pipeline(plugins, arch.vocab_size, tokenizer, _cpu())
    except BaseException:
        for replica in replicas:
            replica.kill()
        if on_close is not None:
            on_close()
        raise
    loaded = SimpleNamespace(arch=arch, tokenizer=tokenizer, max_model_len=max_model_len)
    log.info("Data-parallel replicas ready", replicas=len(replicas), ports=[r.address.port for r in replicas])
    num_blocks = min(r.address.num_blocks for r in replicas)
    if roles is not None:
        log.info("Disaggregated: prefill and decode replicas", prefill=list(roles.prefill), decode=list(roles.decode),
                 connector=config.parallel.disaggregation.connector)  # fmt: skip
    return ReplicaFrontEnd(config, plugins.registries, loaded, replicas, pipeline.extra_params, num_blocks, on_close,
                           roles=roles)  # fmt: skip


def _one_replica(config: CadenzaConfig, shape: ReplicaShape) -> CadenzaConfig:
    """The config each replica runs: one engine of `shape.ranks` ranks, `shape.threads` threads a
    rank (its part in disaggregation comes with its `--kv-peer`; the connector's name stays)."""
    alone = config.parallel.disaggregation.model_copy(update={"prefill": 0, "decode": 0})
    parallel = config.parallel.model_copy(update={"data_parallel_size": 1, "disaggregation": alone})
    # Replicas share the machine's cores: each pinning "its" cores would pin them all to the same
    # ones (auto picks the first cores the process may use); a listed binding is the user's.
    binding = "none" if config.model.thread_binding == "auto" else config.model.thread_binding
    model = config.model.model_copy(update={"num_threads": shape.threads, "thread_binding": binding})
    return config.model_copy(update={"parallel": parallel, "model": model})


def _cpu():
    import torch

    return torch.device("cpu")


def _local_devices(config: CadenzaConfig) -> list[str]:
    """The GPUs local replicas share out (CUDA_VISIBLE_DEVICES' order), or [] on the CPU."""
    import torch

    if config.model.device == "cpu" or not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


def _start_local(config: CadenzaConfig, roles: Roles | None = None) -> tuple[list[LocalProcess], Callable[[], None] | None]:
    """Start the replicas on this machine; returns them and what else `close` must stop (the KV
    connectors' store, which this process hosts for a disaggregated deployment)."""
    parallel = config.parallel
    devices = _local_devices(config)
    shape = plan_replicas(parallel.data_parallel_size, parallel.tensor_parallel_size, config.model.num_threads,
                          cores=os.cpu_count() or 1, gpus=len(devices), use_gpus=bool(devices), where="this machine")  # fmt: skip
    config_json = _one_replica(config, shape).model_dump_json()
    store = port = None
    if roles is not None:
        from cadenza.cluster.kv_transfer import host_store

        store, port = host_store()
    replicas = []
    for index in range(shape.replicas):
        extra = {"CUDA_VISIBLE_DEVICES": visible_devices(index, shape.ranks, devices)} if devices else None
        kv_peer = None if roles is None else peer_flag(index, roles.world_size, "127.0.0.1", port)
        argv, env = replica_command(config_json, index, extra_env=extra, kv_peer=kv_peer)
        name = f"data-parallel replica {index}" + ("" if roles is None else f" ({roles.role(index)})")
        replicas.append(LocalProcess(name, argv, env, ready=READY, error=ReplicaFailedError))
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready(START_SECONDS)
    except BaseException:
        for replica in replicas:
            replica.kill()
        raise
    if store is None:
        return replicas, None
    served = [store]  # the store serves while referenced: `close` drops it, after the replicas stopped
    return replicas, served.clear
