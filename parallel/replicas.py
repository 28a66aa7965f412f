"""Data parallelism: N engine replicas (processes) behind one server port, started and stopped.

The server process loads no model: `start_replicas` starts the replicas (`replica_server.py`) and
returns a `FrontendRuntime` (tokenizer, limits, plugins: what the API layer reads). The app then
serves a `DataParallelEngine` (`dp_engine.py`), which has `AsyncEngine`'s interface.
`FrontendRuntime.close` terminates the replicas, and a local one also dies with its parent, so
none outlives its server.

Replicas on other machines: `launcher: ray` (the `cadenza[ray]` extra) starts each replica as a
Ray actor and connects to it over TCP; see docs/scale-out.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import structlog

from cadenza.config import CadenzaConfig
from cadenza.parallel.errors import ParallelError, ReplicaFailedError
from cadenza.parallel.replica_server import CONFIG_ENV, INDEX_ENV

log = structlog.get_logger(__name__)

_READY = re.compile(r"cadenza replica ready on (\S+):(\d+) blocks (\d+)")
START_SECONDS = 300.0


@dataclass
class ReplicaProcess:
    index: int
    host: str
    port: int
    num_blocks: int
    process: subprocess.Popen | None = None  # None for a replica another launcher started (Ray)
    handle: Any = None  # the Ray actor that runs it, for `launcher: ray`

    def exit_status(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self, timeout: float = 10.0) -> None:
        if self.handle is not None:
            import ray

            ray.kill(self.handle)
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()  # nothing to save: its requests have ended with the server's
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class FrontendRuntime:
    """What the API layer reads of a runtime, for a server whose engines are replicas."""

    config: CadenzaConfig
    registries: Any
    loaded: Any  # .arch, .tokenizer, .max_model_len
    replicas: list[ReplicaProcess]
    extra_params: Any = None
    num_blocks: int = 0
    closed: bool = field(default=False)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    def serve_engine(self, runtime, **kwargs):
        from cadenza.parallel.dp_engine import DataParallelEngine

        return DataParallelEngine.serve(self, **kwargs)

    def failure(self) -> str | None:
        for replica in self.replicas:
            code = replica.exit_status()
            if code is not None and not self.closed:
                return f"data-parallel replica {replica.index} exited with status {code}"
        return None

    def close(self) -> None:
        self.closed = True
        for replica in self.replicas:
            replica.stop()


def start_replicas(config: CadenzaConfig) -> FrontendRuntime:
    """Start `parallel.data_parallel_size` replicas and wait until each listens."""
    from cadenza.models.loading import load_tokenizer
    from cadenza.runtime import build_sampling_pipeline, resolve_plugins

    size = config.parallel.data_parallel_size
    if config.parallel.tensor_parallel_size > 1:
        raise ParallelError("data_parallel_size > 1 with tensor_parallel_size > 1 is not supported yet")
    plugins = resolve_plugins(config)
    one = config.model_copy(update={"parallel": config.parallel.model_copy(update={"data_parallel_size": 1})})
    if config.model.num_threads is None:  # the replicas share this machine's cores
        threads = max(1, (os.cpu_count() or 1) // size)
        one = one.model_copy(update={"model": one.model.model_copy(update={"num_threads": threads})})
    if config.parallel.launcher == "ray":
        from cadenza.parallel.ray_replicas import start_ray_replicas

        replicas = start_ray_replicas(one, size)
    else:
        replicas = _start_local(one, size)
    try:
        arch, tokenizer, max_model_len = load_tokenizer(config.model.path, config.model.max_model_len)
        pipeline = build_sampling_pipeline(plugins, arch.vocab_size, tokenizer, _cpu())
    except BaseException:
        for replica in replicas:
            if replica.process is not None:
                replica.process.kill()
        raise
    loaded = SimpleNamespace(arch=arch, tokenizer=tokenizer, max_model_len=max_model_len)
    log.info("Data-parallel replicas ready", replicas=size, ports=[r.port for r in replicas])
    return FrontendRuntime(config, plugins.registries, loaded, replicas, pipeline.extra_params, min(r.num_blocks for r in replicas))


def _cpu():
    import torch

    return torch.device("cpu")


def _start_local(config: CadenzaConfig, size: int) -> list[ReplicaProcess]:
    from cadenza.parallel.launch import _die_with_parent

    processes = []
    for index in range(size):
        env = dict(os.environ, **{CONFIG_ENV: config.model_dump_json(), INDEX_ENV: str(index)})
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "cadenza.parallel.replica_server"], env=env, stdout=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
        ))  # fmt: skip
    replicas = []
    try:
        for index, process in enumerate(processes):
            host, port, blocks = _wait_ready(process, index)
            replicas.append(ReplicaProcess(index, host, port, blocks, process))
    except BaseException:
        for process in processes:
            process.kill()
            process.wait()
        raise
    return replicas


def _wait_ready(process: subprocess.Popen, index: int) -> tuple[str, int, int]:
    found: list[tuple[str, int, int]] = []

    def read() -> None:
        for line in process.stdout:
            match = _READY.search(line)
            if match:
                found.append((match.group(1), int(match.group(2)), int(match.group(3))))
                break
        process.stdout.close()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(START_SECONDS)
    if not found:
        raise ReplicaFailedError(f"data-parallel replica {index} did not start (status {process.poll()})")
    return found[0]
