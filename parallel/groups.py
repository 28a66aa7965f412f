"""The torch.distributed process group of a tensor-parallel engine, and a rank's place in it.

Rendezvous is always `env://` (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), which both our own
launcher (`launch.py`) and `torchrun` set. The backend is one choice: `gloo` on the CPU, `nccl` on
CUDA. Every collective runs under the group's timeout, so a dead peer fails the caller instead of
hanging it. On joining, the ranks exchange where they run (`ParallelContext.peers`), so that rank 0
can name a rank on another machine that stops answering.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger(__name__)

# The variables torchrun (and our launcher) set for every rank.
ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """A rank's place in the tensor-parallel group: all collectives go through `group` (None: the
    default group). `device` is where the rank's tensors (and so its collectives) live."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None = None
    peers: tuple[str, ...] = ()  # per rank, where it runs: "host pid N"

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the engine (scheduler, sampling); the others only run the model."""
        return self.rank == 0


def backend_for(name: str, device: torch.device) -> str:
    """`parallel.backend` as a torch.distributed backend: auto is nccl on CUDA, gloo elsewhere."""
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return name


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of an external launch (torchrun sets these)."""
    return all(v in os.environ for v in ENV_VARS) and int(os.environ["WORLD_SIZE"]) > 1


def env_rank() -> tuple[int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host`, for the rendezvous of ranks on one machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether `host` is literally this machine's loopback (never resolved: a hostname that resolves
    to 127.0.1.1 on its own machine may be another machine's way to reach it)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def use_loopback_interface(backend: str) -> None:
    """A rendezvous on loopback means every rank runs on this machine (a remote rank could not reach
    it): pin gloo to the loopback interface (GLOO_SOCKET_IFNAME=lo), unless one was chosen. By
    default gloo binds the address this machine's hostname resolves to, which on some hosts and
    containers is an address no peer can connect to."""
    if backend != "gloo" or "GLOO_SOCKET_IFNAME" in os.environ or not is_loopback(os.environ.get("MASTER_ADDR", "")):
        return
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    for name in ("lo", "lo0"):
        if name in names:
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


def init_group(rank: int, world_size: int, device: torch.device, backend: str, timeout: float) -> ParallelContext:
    """Join the group over env:// (our launcher or torchrun has set MASTER_ADDR and MASTER_PORT)."""
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    backend = backend_for(backend, device)
    use_loopback_interface(backend)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )
    peers: list[str | None] = [None] * world_size
    dist.all_gather_object(peers, f"{socket.gethostname()} pid {os.getpid()}")
    log.info("Joined tensor-parallel group", rank=rank, world_size=world_size, backend=dist.get_backend(),
             master=f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
             interface=os.environ.get("GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME"))  # fmt: skip
    return ParallelContext(rank, world_size, device, peers=tuple(str(p) for p in peers))


# Loading a model can take far longer than any collective should: the barrier that waits for every
# rank's shard has its own bound.
LOAD_SECONDS = 900.0


def loaded_barrier(ctx: ParallelContext) -> None:
    """Wait until every rank has loaded its shard; `RankFailedError` when one died or never came
    (gloo names it)."""
    from cadenza.parallel.errors import RankFailedError

    try:
        if dist.get_backend(ctx.group) == "gloo":
            dist.monitored_barrier(ctx.group, timeout=timedelta(seconds=LOAD_SECONDS), wait_all_ranks=True)
        else:
            dist.barrier(ctx.group)
    except RuntimeError as exc:
        raise RankFailedError(f"a tensor-parallel rank failed while the model loaded: {exc}") from exc


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
