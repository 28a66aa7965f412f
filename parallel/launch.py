"""Bringing up a tensor-parallel group for rank 0's engine, watching it, taking it down.

Two ways in, one rendezvous (`env://`):
- `cadenza serve --tensor-parallel-size N` on one machine: this process is rank 0 and starts ranks
  1..N-1 as child processes (`python -m cadenza.parallel.worker`), on a free loopback port. A child
  dies with its parent (PR_SET_PDEATHSIG on Linux), and in any case leaves when a collective fails.
- `torchrun --nnodes ... --nproc-per-node K -m cadenza serve ...`: torchrun starts every rank and
  sets the rendezvous variables; rank 0 serves, the others run `worker.run_worker` from the CLI.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from dataclasses import dataclass, field

import structlog
import torch

from cadenza.config import CadenzaConfig
from cadenza.parallel.errors import ParallelError
from cadenza.parallel.groups import ParallelContext, destroy_group, env_rank, free_port, init_group, launched_by_torchrun
from cadenza.parallel.tp_runner import TensorParallelModel
from cadenza.parallel.worker import CONFIG_ENV

log = structlog.get_logger(__name__)

STOP_SECONDS = 10.0  # how long ranks get to leave after STOP before they are terminated


@dataclass
class TensorParallelGroup:
    """Rank 0's handle: its place in the group, the ranks it started (none under torchrun) and,
    once the model is loaded, the driver that sends them every step."""

    ctx: ParallelContext
    processes: dict[int, subprocess.Popen] = field(default_factory=dict)
    driver: TensorParallelModel | None = None
    closed: bool = False

    def wrap(self, model: torch.nn.Module, timeout: float) -> TensorParallelModel:
        self.driver = TensorParallelModel(model, self.ctx, heartbeat_seconds=max(0.5, timeout / 4))
        return self.driver

    def failure(self) -> str | None:
        """Why the group cannot serve any more, or None while it can."""
        if self.closed:
            return None
        for rank, process in self.processes.items():
            code = process.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} exited with status {code}"
        return self.driver.failure if self.driver is not None else None

    def close(self) -> None:
        """Stop the ranks (STOP, then terminate, then kill: every child ends) and leave the group."""
        if self.closed:
            return
        self.closed = True
        if self.driver is not None:
            self.driver.stop()
        for rank, process in self.processes.items():
            try:
                process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                log.warning("Terminating a tensor-parallel rank that did not stop", rank=rank, pid=process.pid)
                process.terminate()
                try:
                    process.wait(5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        destroy_group()
        log.info("Tensor-parallel group stopped", world_size=self.ctx.world_size)


def start_group(config: CadenzaConfig, device: torch.device) -> TensorParallelGroup:
    """Rank 0's group: join torchrun's, or start ranks 1..N-1 here and rendezvous with them."""
    size, timeout = config.parallel.tensor_parallel_size, config.parallel.timeout_seconds
    if launched_by_torchrun():
        rank, world_size = env_rank()
        if world_size != size:
            raise ParallelError(f"torchrun started {world_size} ranks but parallel.tensor_parallel_size is {size}")
        if rank != 0:
            raise ParallelError(f"rank {rank} runs the model only; only rank 0 builds an engine")
        return TensorParallelGroup(init_group(0, size, device, config.parallel.backend, timeout))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    processes = {}
    try:
        for rank in range(1, size):
            processes[rank] = _spawn_rank(config, rank, size)
        log.info("Started tensor-parallel ranks", world_size=size, pids=[p.pid for p in processes.values()])
        group = TensorParallelGroup(init_group(0, size, device, config.parallel.backend, timeout), processes)
        atexit.register(group.close)  # whoever forgets `Runtime.close()`: no rank outlives us
        return group
    except BaseException:
        for process in processes.values():
            process.kill()
            process.wait()
        raise


def _spawn_rank(config: CadenzaConfig, rank: int, world_size: int) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    env[CONFIG_ENV] = config.model_dump_json()
    return subprocess.Popen(
        [sys.executable, "-m", "cadenza.parallel.worker"], env=env, preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL
    )


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the parent dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
