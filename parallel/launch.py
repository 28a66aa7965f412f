"""Bringing up a tensor-parallel group for rank 0's engine, watching it, taking it down.

Two ways in, one rendezvous (`env://`):
- `cadenza serve --tensor-parallel-size N` on one machine: this process is rank 0 and starts ranks
  1..N-1 as child processes (`python -m cadenza.runtime.worker`), on a free loopback port. A child
  dies with its parent (PR_SET_PDEATHSIG on Linux), and in any case leaves when a collective fails.
- `torchrun --nnodes ... --nproc-per-node K -m cadenza serve ...`: torchrun starts every rank and
  sets the rendezvous variables; rank 0 serves, the others run `worker.run_worker` from the CLI.

A rank this process starts is a `LocalProcess` (`lifecycle.py`), as a local replica is; it reports
ready at the group's barrier (`groups.loaded_barrier`), not on stdout. This module imports neither
`worker.py` nor the runtime (which imports it).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from dataclasses import dataclass, field

import structlog
import torch

from cadenza.config import CadenzaConfig, environment
from cadenza.parallel.errors import ParallelError, RankFailedError
from cadenza.parallel.groups import (
    ParallelContext,
    destroy_group,
    env_rank,
    free_port,
    init_group,
    launched_by_torchrun,
)
from cadenza.parallel.lifecycle import Address, LocalProcess
from cadenza.parallel.tp_runner import TensorParallelModel

log = structlog.get_logger(__name__)

STOP_SECONDS = 10.0  # how long ranks get to leave after STOP before they are terminated
TERM_SECONDS = 5.0  # then how long a terminated rank gets before it is killed


@dataclass
class TensorParallelGroup:
    """Rank 0's handle: its place in the group, the ranks it started (none under torchrun) and,
    once the model is loaded, the driver that sends them every step."""

    ctx: ParallelContext
    ranks: dict[int, LocalProcess] = field(default_factory=dict)
    driver: TensorParallelModel | None = None
    closed: bool = False

    @property
    def processes(self) -> dict[int, subprocess.Popen]:
        return {rank: handle.process for rank, handle in self.ranks.items()}

    def wrap(self, model: torch.nn.Module, timeout: float) -> TensorParallelModel:
        self.driver = TensorParallelModel(model, self.ctx, heartbeat_seconds=max(0.5, timeout / 4))
        return self.driver

    def failure(self) -> str | None:
        """Why the group cannot serve any more, or None while it can."""
        if self.closed:
            return None
        for handle in self.ranks.values():
            if (reason := handle.failure()) is not None:
                return reason
        if self.driver is None or self.driver.failure is None:
            return None
        if self.ranks:  # ranks this process started: a dead one is named by its exit status above
            return self.driver.failure
        return f"{external_ranks(self.ctx)}: {self.driver.failure}"

    def close(self) -> None:
        """Stop the ranks (STOP, then terminate, then kill: every child ends) and leave the group."""
        if self.closed:
            return
        self.closed = True
        if self.driver is not None:
            self.driver.stop()
        for rank, handle in self.ranks.items():
            if handle.wait_exit(STOP_SECONDS) is None:
                log.warning("Terminating a tensor-parallel rank that did not stop", rank=rank, pid=handle.pid)
                handle.stop(TERM_SECONDS)
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
    # Every group this process starts has its own port: replicas on one machine never share one.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    rendezvous = Address(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    ranks = {rank: rank_process(config, rank, size, rendezvous) for rank in range(1, size)}
    try:
        for handle in ranks.values():
            handle.start()
        log.info("Started tensor-parallel ranks", world_size=size, pids=[h.pid for h in ranks.values()])
        group = TensorParallelGroup(init_group(0, size, device, config.parallel.backend, timeout), ranks)
        atexit.register(group.close)  # whoever forgets `Runtime.close()`: no rank outlives us
        return group
    except BaseException:
        for handle in ranks.values():
            handle.kill()
        raise


def external_ranks(ctx: ParallelContext) -> str:
    """Under torchrun, the ranks rank 0 cannot watch as processes (maybe on other machines), named with
    where they run: with 2 ranks the one that failed, else the ones that may have."""
    where = [f"rank {r} ({ctx.peers[r] if r < len(ctx.peers) else 'unknown'})" for r in range(1, ctx.world_size)]
    if len(where) == 1:
        return f"tensor-parallel {where[0]}, started by torchrun, failed or stopped answering"
    return f"one of the tensor-parallel ranks started by torchrun failed or stopped answering: {', '.join(where)}"


def rank_process(config: CadenzaConfig, rank: int, world_size: int, rendezvous: Address) -> LocalProcess:
    """Rank `rank` of a group this process leads, as a `LocalProcess` not yet started."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    env[environment.PARALLEL_CONFIG.name] = config.model_dump_json()
    return LocalProcess(f"tensor-parallel rank {rank}", [sys.executable, "-m", "cadenza.runtime.worker"], env,
                        address=rendezvous, error=RankFailedError)  # fmt: skip
