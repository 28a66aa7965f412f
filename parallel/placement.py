"""The shape of a deployment, data-parallel replicas x tensor-parallel ranks, checked up front
against what has to hold it, and what each replica takes (plain logic: no processes, no torch).

Every rank is a process with its own threads; on CUDA each rank holds one GPU. So a deployment of
`data_parallel_size` x `tensor_parallel_size` ranks needs that many CPU cores (CPU) or GPUs (CUDA)
on this machine (launcher local) or in the Ray cluster (launcher ray), and each replica's ranks
share one machine: a replica starts its own tensor-parallel group there, on its own MASTER_PORT.
Under Ray each replica is one bundle of a placement group, which `parallel.ray_placement` spreads
over the nodes or packs onto few (`RAY_STRATEGIES`); `check_bundles_fit` refuses up front what no
placement could hold, where Ray would wait for it forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from cadenza.config.errors import ConfigError

# parallel.ray_placement -> the placement group's strategy (one bundle a replica). Each bundle lands
# whole on one node, so a replica's ranks share it whatever the strategy.
RAY_STRATEGIES = {"spread": "SPREAD", "pack": "PACK", "strict_spread": "STRICT_SPREAD"}


@dataclass(frozen=True, slots=True)
class ReplicaShape:
    """`replicas` engines of `ranks` tensor-parallel ranks each, `threads` torch threads a rank."""

    replicas: int
    ranks: int
    threads: int
    gpus: bool  # each rank holds one GPU

    @property
    def world_size(self) -> int:
        return self.replicas * self.ranks

    def resources(self) -> dict[str, float]:
        """What one replica reserves (a Ray placement-group bundle): its ranks' cores, and a GPU a
        rank on CUDA."""
        bundle = {"CPU": float(self.ranks * self.threads)}
        if self.gpus:
            bundle["GPU"] = float(self.ranks)
        return bundle


def plan_replicas(
    replicas: int, ranks: int, num_threads: int | None, *, cores: int, gpus: int, use_gpus: bool, where: str
) -> ReplicaShape:
    """The shape of `replicas` x `ranks`, or a `ConfigError` naming what does not fit.

    Args:
        num_threads: `model.num_threads`; None shares `cores` evenly among every rank.
        cores, gpus: what `where` ("this machine", "the Ray cluster") has.
        use_gpus: the ranks run on CUDA (one GPU each).
    """
    world = replicas * ranks
    shape = f"data_parallel_size {replicas} x tensor_parallel_size {ranks} = {world} ranks"
    if use_gpus and world > gpus:
        raise ConfigError(f"parallel: {shape}, one GPU each, but {where} has {gpus} GPU{'s' * (gpus != 1)}; "
                          "lower data_parallel_size or tensor_parallel_size")  # fmt: skip
    if not use_gpus and world > cores:
        raise ConfigError(f"parallel: {shape}, one process each, but {where} has {cores} CPU "
                          f"core{'s' * (cores != 1)}; lower data_parallel_size or tensor_parallel_size")  # fmt: skip
    threads = num_threads or max(1, cores // world)
    return ReplicaShape(replicas, ranks, threads, use_gpus)


def visible_devices(index: int, ranks: int, devices: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES for local replica `index`: its own `ranks` of `devices`, in order."""
    return ",".join(devices[index * ranks : (index + 1) * ranks])


def copies_on(bundle: Mapping[str, float], node: Mapping[str, float]) -> int:
    """How many `bundle`s a node of these resources holds at once."""
    return min((int(node.get(k, 0) // v) for k, v in bundle.items() if v > 0), default=0)


def check_bundles_fit(
    bundle: Mapping[str, float], replicas: int, placement: str, nodes: Sequence[tuple[str, Mapping[str, float]]]
) -> None:
    """A `ConfigError` unless `replicas` bundles fit `nodes` ((name, such as its IP; its total
    resources) each) under `parallel.ray_placement`: every strategy puts each bundle whole on one
    node; strict_spread also puts each on a node of its own. Totals, not what is free: what other
    jobs hold is Ray's to wait for."""
    fits = [(name, copies_on(bundle, resources)) for name, resources in nodes]
    holding = sum(1 for _, n in fits if n)
    where = ", ".join(f"{name}: {n}" for name, n in fits)
    if placement == "strict_spread" and holding < replicas:
        raise ConfigError(f"parallel.ray_placement strict_spread puts each of {replicas} replicas on a node of its "
                          f"own, but {holding} of the Ray cluster's {len(fits)} nodes can hold one ({bundle}); "
                          "add nodes, or set ray_placement: spread")  # fmt: skip
    if sum(n for _, n in fits) < replicas:
        raise ConfigError(f"parallel: each replica needs {bundle} on one node (its tensor-parallel ranks share a "
                          f"machine); the Ray cluster's nodes hold {sum(n for _, n in fits)} such replicas ({where}), "
                          f"not {replicas}; lower model.num_threads or data_parallel_size")  # fmt: skip
