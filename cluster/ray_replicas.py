"""`parallel.launcher: ray`: data-parallel replicas under Ray actors, on one machine or a cluster.

Imported only for that launcher; Ray comes with the `cadenza[ray]` extra. Where Ray runs:
- `RAY_ADDRESS` set: that cluster (`auto`: the one this machine belongs to).
- unset: a cluster this machine has joined (`ray start`), else a local instance that cadenza starts
  (`ray.init(num_cpus=..., include_dashboard=False)`) and shuts down when it stops.

Each replica reserves its CPUs (and a GPU a rank on CUDA) as one bundle of the deployment's
placement group, so its tensor-parallel ranks share a node; `parallel.ray_placement` spreads the
bundles over the nodes (default) or packs them. Its actor, a `ReplicaSupervisor`, starts one
`replica_server` process there and lives exactly as long as it: when the replica dies, the actor
exits and Ray restarts it (`parallel.max_restarts`), which starts a new replica; when the actor
dies, the replica sees its stdin close and leaves. A lost node's bundles are placed again wherever
they fit, and its actors restart there. The server connects to each replica over TCP as to a local
one (at its node's Ray address when that node is another machine), and reconnects to a restarted
one once it reports ready (`RayReplica.wait_ready`).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import structlog

from cadenza.config import CadenzaConfig
from cadenza.config.errors import ConfigError
from cadenza.parallel.errors import ParallelError, ReplicaFailedError
from cadenza.parallel.lifecycle import Address, LocalProcess, ManagedProcess
from cadenza.parallel.placement import RAY_STRATEGIES, ReplicaShape, check_bundles_fit, plan_replicas

log = structlog.get_logger(__name__)

START_SECONDS = 300.0
OBJECT_STORE_BYTES = 100 << 20  # a local instance's shared memory: frames go over TCP, not Ray
POLL_SECONDS = 0.25
LOOPBACK = "127.0.0.1"


def _ray():
    try:
        import ray
    except ImportError as exc:
        raise ParallelError("parallel.launcher is ray, but Ray is not installed: pip install 'cadenza[ray]'") from exc
    return ray


@dataclass
class RaySession:
    """This process's link to Ray. `started`: cadenza started a local instance (and stops it);
    `connected`: cadenza connected to a cluster (and disconnects); neither: someone else did."""

    started: bool
    connected: bool

    def close(self) -> None:
        ray = _ray()
        if (self.started or self.connected) and ray.is_initialized():
            ray.shutdown()
            log.info("Stopped the local Ray instance" if self.started else "Disconnected from the Ray cluster")


def connect_ray(num_cpus: int) -> RaySession:
    """Join RAY_ADDRESS's cluster, or this machine's, or start a local instance of `num_cpus`."""
    ray = _ray()
    if ray.is_initialized():
        return RaySession(False, False)
    address = os.environ.get("RAY_ADDRESS")
    if address and address.startswith("ray://"):
        # Under Ray Client this process is no node of the cluster: no way to tell which replicas share
        # its machine, nor to count on reaching the others.
        raise ConfigError(f"RAY_ADDRESS={address}: Ray Client (ray://) cannot carry the replicas' connections; run "
                          "cadenza serve on a node of the cluster with RAY_ADDRESS=auto or the head's HOST:6379")  # fmt: skip
    try:
        ray.init(address=address or "auto")
        log.info("Connected to a Ray cluster", address=address or "auto", nodes=len(_alive_nodes()))
        return RaySession(False, True)
    except ConnectionError:
        if address:
            raise
    started = time.perf_counter()
    ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES)
    log.info("Started a local Ray instance", num_cpus=num_cpus, seconds=round(time.perf_counter() - started, 2))
    return RaySession(True, False)


def _alive_nodes() -> list[dict]:
    return [n for n in _ray().nodes() if n.get("Alive")]


def replica_host(server_ip: str) -> str:
    """Where a replica on this node listens: loopback on the server's own machine (nothing else
    connects to it), else this node's Ray address, which the other nodes reach (Ray's own traffic
    uses it); never every interface."""
    node_ip = _ray().util.get_node_ip_address()
    return LOOPBACK if node_ip == server_ip else node_ip


class ReplicaSupervisor:
    """The body of a replica's Ray actor: runs one replica process on its node, and exits when
    that dies after it served (so that Ray restarts both). One that never got ready is not
    restarted: it would fail again. Methods answer plain tuples, never raise across Ray."""

    def __init__(self, config_json: str, index: int, server_ip: str, kv_peer: tuple[int, int, int] | None = None) -> None:
        """`kv_peer`: (connector rank, world size, store port) in a disaggregated deployment, whose
        store the server hosts at `server_ip`."""
        from cadenza.cluster.kv_transfer import peer_flag
        from cadenza.cluster.replica_server import READY, replica_command

        # Decided here, on the node Ray placed (or, after a lost node, placed again) this actor.
        host = replica_host(server_ip)
        flag = None
        if kv_peer is not None:  # the server's store: over loopback from its own machine
            rank, world_size, port = kv_peer
            flag = peer_flag(rank, world_size, LOOPBACK if host == LOOPBACK else server_ip, port)
        argv, env = replica_command(config_json, index, host=host, lifeline=True, kv_peer=flag)
        self.replica = LocalProcess(f"data-parallel replica {index}", argv, env, ready=READY, error=ReplicaFailedError,
                                    lifeline=True)  # fmt: skip
        self.replica.start()
        self._address: Address | None = None
        self._ready, self._exited = threading.Event(), threading.Event()
        self._stopping = False
        threading.Thread(target=self._wait_ready, daemon=True).start()
        threading.Thread(target=self._exit_with_replica, daemon=True).start()

    def _wait_ready(self) -> None:
        try:
            self._address = self.replica.wait_ready(START_SECONDS)
        except ReplicaFailedError:
            pass
        self._ready.set()

    def _exit_with_replica(self) -> None:
        self.replica.process.wait()
        self._exited.set()
        if self._address is not None and not self._stopping:
            os._exit(1)  # Ray restarts this actor, and with it the replica

    def address(self, wait: float) -> tuple[str, Address | int | None]:
        """("ready", address); ("starting", None) after `wait` seconds; ("failed", status): it never
        got ready; ("exited", status): it served, then died (this actor is about to exit)."""
        if not self._ready.wait(wait):
            return ("starting", None)
        if self._address is None:
            return ("failed", self.replica.exit_status())
        if self._exited.is_set():
            return ("exited", self.replica.exit_status())
        return ("ready", self._address)

    def watch(self) -> int | None:
        """Returns once the replica exited (its status); fails when the actor dies first."""
        self._exited.wait()
        return self.replica.exit_status()

    def stop(self, grace: float) -> int | None:
        self._stopping = True
        self.replica.stop(grace)
        return self.replica.exit_status()


class RayReplica(ManagedProcess):
    """The server's handle on one replica under a Ray actor (see `ReplicaSupervisor`)."""

    def __init__(self, index: int, config_json: str, group, bundle: dict[str, float], max_restarts: int, server_ip: str,
                 kv_peer: tuple[int, int, int] | None = None) -> None:  # fmt: skip
        """`group`: the deployment's placement group, whose bundle `index` (`bundle`) this replica
        takes; the group belongs to `start_ray_replicas`, which removes it after every replica
        stopped. `kv_peer`: see `ReplicaSupervisor`."""
        self.name = f"data-parallel replica {index}"
        self.index = index
        self.config_json, self.bundle, self.max_restarts, self.server_ip = config_json, bundle, max_restarts, server_ip
        self.kv_peer = kv_peer
        self.restarts = max_restarts > 0
        self.actor = None
        self.group = group
        self.address: Address | None = None
        self._watch = None  # resolves when the current incarnation's replica exits
        self._placed = self._stopped = False

    def start(self) -> None:
        _ray()  # a clear error without Ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options = dict(
            num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0), max_restarts=self.max_restarts,
            max_task_retries=0, max_concurrency=4,  # address, watch and stop at once
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=self.index),
        )  # fmt: skip
        self.actor = _supervisor_class().options(**options).remote(self.config_json, self.index, self.server_ip, self.kv_peer)

    def wait_ready(self, timeout: float) -> Address:
        ray = _ray()
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

        if self.actor is None:
            raise ReplicaFailedError(f"{self.name} was never started")
        if self.is_alive():
            return self.address
        deadline = time.monotonic() + timeout
        if not self._placed:
            try:
                ray.get(self.group.ready(), timeout=timeout)
            except GetTimeoutError:
                raise ReplicaFailedError(f"Ray could not place {self.name} within {timeout:.0f} s: it needs {self.bundle} on "
                                         "one node, beside the other replicas' bundles") from None  # fmt: skip
            self._placed = True
        while not self._stopped:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                state, value = ray.get(self.actor.address.remote(min(left, 5.0)), timeout=left + 10)
            except ActorUnavailableError:  # restarting
                time.sleep(POLL_SECONDS)
                continue
            except ActorDiedError as exc:
                raise ReplicaFailedError(f"{self.name} died and Ray does not restart it (max_restarts {self.max_restarts}): {exc}") from None
            except GetTimeoutError:
                break
            if state == "ready":
                self.address = value
                self._watch = self.actor.watch.remote()
                return value
            if state == "exited" and self.restarts:
                time.sleep(POLL_SECONDS)  # its actor is about to exit, and Ray to restart it
                continue
            if state != "starting":
                raise ReplicaFailedError(f"{self.name} did not start (status {value})" if state == "failed"
                                         else f"{self.name} exited with status {value}")  # fmt: skip
        raise ReplicaFailedError(f"{self.name} was stopped" if self._stopped else f"{self.name} did not start within {timeout:.0f} s")

    def is_alive(self) -> bool:
        if self._watch is None or self._stopped:
            return False
        ready, _ = _ray().wait([self._watch], timeout=0)
        return not ready

    def kill(self) -> None:
        """SIGKILL the actor (and so its replica); Ray restarts it while restarts are left."""
        ray = _ray()
        watch = self._watch
        if self.actor is not None:
            ray.kill(self.actor, no_restart=not self.restarts)
        if watch is not None:
            ray.wait([watch], timeout=10)  # gone before anyone asks it for its address again

    def stop(self, grace: float) -> None:
        if self._stopped or self.actor is None:
            self._stopped = True
            return
        try:
            alive = self.is_alive()
        except Exception:  # Ray itself is gone: nothing to ask
            alive = False
        self._stopped = True
        ray = _ray()
        # Only a serving replica is asked: a restarting actor (say, its node lost and no room for its
        # bundle elsewhere) would take the call only once placed again, if ever.
        if alive:
            try:
                ray.get(self.actor.stop.remote(grace), timeout=grace + 5)
            except Exception as exc:  # it died meanwhile: killing it is all that is left
                log.info("Replica actor did not stop itself", replica=self.index, error=type(exc).__name__)
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # Ray itself is gone (shut down, or the cluster lost): so is the actor
            log.warning("Could not remove a replica's actor", replica=self.index, error=repr(exc))


@functools.cache
def _supervisor_class():
    return _ray().remote(ReplicaSupervisor)


def start_ray_replicas(
    config: CadenzaConfig, one_replica: Callable[[ReplicaShape], CadenzaConfig], kv_world: int | None = None
) -> tuple[list[RayReplica], Callable[[], None]]:
    """Start `data_parallel_size` replicas on Ray and wait for each; returns them and what closes
    the deployment's placement group and the Ray session. `one_replica(shape)`: the config each
    replica runs. `kv_world`: a disaggregated deployment's connector world (every replica): this
    process then hosts the store the connectors meet in, and no replica is restarted (one could
    not rejoin its connectors' group)."""
    parallel = config.parallel
    world = parallel.data_parallel_size * parallel.tensor_parallel_size
    max_restarts = parallel.max_restarts if kv_world is None else 0
    session = connect_ray(max(os.cpu_count() or 1, world * (config.model.num_threads or 1)))
    replicas: list[RayReplica] = []
    group = None
    store = port = None

    def close() -> None:
        nonlocal store
        store = None  # the connectors' store serves while referenced: after the replicas stopped
        if group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(group)  # after the actors: it would kill them unasked
            except Exception as exc:  # Ray itself is gone: so is the group
                log.warning("Could not remove the replicas' placement group", error=repr(exc))
        session.close()

    try:
        ray = _ray()
        from ray.util.placement_group import placement_group

        resources = ray.cluster_resources()
        cores, gpus = int(resources.get("CPU", 0)), int(resources.get("GPU", 0))
        if session.started:  # its CPUs are logical (enough for the bundles); the cores are this machine's
            cores = os.cpu_count() or 1
        use_gpus = config.model.device == "cuda" or (config.model.device == "auto" and gpus > 0)
        where = "this machine" if session.started else "the Ray cluster"
        shape = plan_replicas(parallel.data_parallel_size, parallel.tensor_parallel_size, config.model.num_threads,
                              cores=cores, gpus=gpus, use_gpus=use_gpus, where=where)  # fmt: skip
        bundle = shape.resources()
        nodes = [(n["NodeManagerAddress"], n["Resources"]) for n in _alive_nodes()]
        check_bundles_fit(bundle, shape.replicas, parallel.ray_placement, nodes)
        # One group for the deployment: Ray places its bundles all at once, by the strategy.
        group = placement_group([bundle] * shape.replicas, strategy=RAY_STRATEGIES[parallel.ray_placement])
        server_ip = ray.util.get_node_ip_address()  # the replicas on this machine listen on loopback
        config_json = one_replica(shape).model_dump_json()
        if kv_world is not None:
            from cadenza.cluster.kv_transfer import host_store

            store, port = host_store()  # it listens on every interface: replicas on other nodes reach server_ip
        replicas = [RayReplica(i, config_json, group, bundle, max_restarts, server_ip,
                               None if kv_world is None else (i, kv_world, port)) for i in range(shape.replicas)]  # fmt: skip
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready(START_SECONDS)
        log.info("Started replicas on Ray", replicas=len(replicas), bundle=bundle, placement=parallel.ray_placement,
                 nodes=_bundle_nodes(group), addresses=[f"{r.address.host}:{r.address.port}" for r in replicas],
                 max_restarts=max_restarts)  # fmt: skip
    except BaseException:
        for replica in replicas:
            replica.stop(0)
        close()
        raise
    return replicas, close


def _bundle_nodes(group) -> list[str]:
    """The node (its Ray address) each replica's bundle was placed on, in replica order."""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in _alive_nodes()}
    placed = _ray().util.placement_group_table(group)["bundles_to_node_id"]
    return [ips.get(placed.get(i), "?") for i in range(len(placed))]
