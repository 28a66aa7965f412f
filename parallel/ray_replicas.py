"""`parallel.launcher: ray`: data-parallel replicas as Ray actors, across a Ray cluster's machines.

Imported only for that launcher; Ray comes with the `cadenza[ray]` extra. Each actor starts one
`replica_server` process on its node, listening on all interfaces, and reports its address; the
server then connects to each over TCP exactly as to local replicas. Connect this process to the
cluster with RAY_ADDRESS (default "auto": the cluster this machine belongs to).
"""

from __future__ import annotations

import os
import subprocess
import sys

from cadenza.config import CadenzaConfig
from cadenza.parallel.errors import ParallelError


def start_ray_replicas(config: CadenzaConfig, size: int) -> list:
    try:
        import ray
    except ImportError as exc:
        raise ParallelError("parallel.launcher is ray, but Ray is not installed: pip install 'cadenza[ray]'") from exc
    from cadenza.parallel.replica_server import CONFIG_ENV, HOST_ENV, INDEX_ENV
    from cadenza.parallel.replicas import ReplicaProcess, _wait_ready

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), ignore_reinit_error=True)

    @ray.remote
    class ReplicaActor:
        """Owns one replica process on its node; killing the actor ends the process with it."""

        def __init__(self, config_json: str, index: int) -> None:
            env = dict(os.environ, **{CONFIG_ENV: config_json, INDEX_ENV: str(index), HOST_ENV: "0.0.0.0"})
            self.process = subprocess.Popen(
                [sys.executable, "-m", "cadenza.parallel.replica_server"], env=env, stdout=subprocess.PIPE, text=True
            )
            self.index = index

        def address(self) -> tuple[str, int, int]:
            _, port, blocks = _wait_ready(self.process, self.index)
            return ray.util.get_node_ip_address(), port, blocks

    threads = config.model.num_threads or 1
    actors = [ReplicaActor.options(num_cpus=threads).remote(config.model_dump_json(), i) for i in range(size)]
    addresses = ray.get([actor.address.remote() for actor in actors])
    return [ReplicaProcess(i, host, port, blocks, None, actor) for i, ((host, port, blocks), actor) in enumerate(zip(addresses, actors))]
