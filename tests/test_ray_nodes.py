"""Data-parallel replicas across two Ray nodes of one machine (docs/scale-out.md, "DP across nodes
with Ray"): a head and a second node started with `ray.cluster_utils.Cluster`, the second on
127.0.0.2 standing in for another machine's address, and the real `cadenza serve
--data-parallel-size 2` with `parallel.launcher: ray` and RAY_ADDRESS pointing at the head. Ray says
where each replica's actor lives; the sockets say where each replica listens and that the server
reached it there. Then the second node is removed mid-request. The cluster keeps its files (and its
`ray_current_cluster`, which `RAY_ADDRESS=auto` reads) in a directory of its own, so that no other
test on this machine joins it; everything is stopped in `finally` blocks, the server by its process
group, the nodes by `cluster.shutdown()`."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time

import httpx
import psutil
import pytest
from server_process import ServerProcess
from single_engine import greedy_texts
from tiny_models import build_tiny_model

from cadenza.config import ConfigError
from cadenza.parallel.placement import RAY_STRATEGIES, check_bundles_fit

SECOND_NODE_IP = "127.0.0.2"  # loopback too, but not the head's address: "another machine" to Ray
PROMPTS = [[5, 6, 7, 8, 9], [30, 31, 32], list(range(100, 121)), [40, 41]]
MAX_TOKENS = 8
BOUND_SECONDS = 110  # the whole serving test, start-up to shutdown, on a busy 2-core machine
SERVE_ENV = {
    "CADENZA_PARALLEL__LAUNCHER": "ray", "CADENZA_PARALLEL__ROUTER": "round_robin",
    "CADENZA_PARALLEL__MAX_RESTARTS": "1",
    # One thread a replica: two 1-CPU bundles, which fit one node, so that it is the placement
    # (spread, the default) that puts them on two. No compiled kernels: a build must not count here.
    "CADENZA_MODEL__NUM_THREADS": "1", "CADENZA_MODEL__CPU_KERNELS": "off", "CADENZA_CACHE__NUM_BLOCKS": "160",
}  # fmt: skip
# Requests long enough to be running when a node goes: 2000 tokens (seconds), against ~1 s for the
# loss to reach them; the reader stops once it has seen what it needs.
CONTEXT, LONG_TOKENS = 2048, 2000


# --- the fit check alone ------------------------------------------------------------------------------


def test_bundles_are_checked_against_each_node_before_ray_would_wait_forever():
    nodes = [("10.0.0.1", {"CPU": 8.0, "GPU": 2.0}), ("10.0.0.2", {"CPU": 8.0, "GPU": 2.0}), ("10.0.0.3", {"CPU": 4.0})]
    check_bundles_fit({"CPU": 4.0}, 5, "spread", nodes)  # 2 + 2 + 1
    check_bundles_fit({"CPU": 2.0, "GPU": 1.0}, 4, "pack", nodes)
    check_bundles_fit({"CPU": 4.0}, 3, "strict_spread", nodes)
    with pytest.raises(ConfigError, match=r"hold 5 such replicas \(10.0.0.1: 2, 10.0.0.2: 2, 10.0.0.3: 1\), not 6"):
        check_bundles_fit({"CPU": 4.0}, 6, "spread", nodes)
    with pytest.raises(ConfigError, match="strict_spread .* but 2 of the Ray cluster's 3 nodes can hold one"):
        check_bundles_fit({"CPU": 2.0, "GPU": 1.0}, 3, "strict_spread", nodes)
    with pytest.raises(ConfigError, match="hold 0 such replicas"):  # no node holds a whole replica
        check_bundles_fit({"CPU": 16.0}, 1, "pack", nodes)


def test_ray_client_addresses_are_refused_before_connecting(monkeypatch):
    ray = pytest.importorskip("ray")
    from cadenza.cluster.ray_replicas import connect_ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # whatever another test left connected
    monkeypatch.setenv("RAY_ADDRESS", "ray://10.0.0.1:10001")
    with pytest.raises(ConfigError, match=r"Ray Client \(ray://\) cannot carry the replicas' connections"):
        connect_ray(1)


# --- two Ray nodes on this machine --------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """A head (this machine's Ray address) and a second node on 127.0.0.2, 2 CPUs each, each with
    a resource naming it; this process joins as a driver, to ask Ray where things are."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    temp = tempfile.mkdtemp(prefix="cdzray", dir="/tmp")  # short: Ray's socket paths live below it
    nodes = None
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", temp)  # its ray_current_cluster, for `auto`, too; the nodes inherit it
        env.delenv("RAY_ADDRESS", raising=False)
        try:
            nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"cadenza_head": 1},
                                                                   "include_dashboard": False})  # fmt: skip
            nodes.add_node(num_cpus=2, resources={"cadenza_second": 1}, node_ip_address=SECOND_NODE_IP)
            nodes.wait_for_nodes(30)
            ray.init(address=nodes.address)
            yield nodes
        finally:
            if ray.is_initialized():
                ray.shutdown()
            if nodes is not None:
                nodes.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


def node_named(ray, resource: str) -> dict:
    (node,) = [n for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return node


def wait_for_cpus(ray, cpus: float, timeout: float = 20.0) -> None:
    """Until `cpus` are free again (a removed placement group gives its bundles back asynchronously)."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0) < cpus:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


def test_ray_placement_spreads_packs_or_strictly_spreads_the_replicas_bundles(cluster):
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    nodes = [(n["NodeManagerAddress"], n["Resources"]) for n in ray.nodes() if n["Alive"]]
    check_bundles_fit({"CPU": 1.0}, 4, "pack", nodes)
    with pytest.raises(ConfigError, match="but 2 of the Ray cluster's 2 nodes can hold one"):
        check_bundles_fit({"CPU": 1.0}, 3, "strict_spread", nodes)
    used = {}
    for placement in ("pack", "spread", "strict_spread"):
        wait_for_cpus(ray, 4)  # both nodes empty: pack has the room to put both on one
        group = placement_group([{"CPU": 1.0}] * 2, strategy=RAY_STRATEGIES[placement])
        try:
            ray.get(group.ready(), timeout=30)
            used[placement] = len(set(placement_group_table(group)["bundles_to_node_id"].values()))
        finally:
            remove_placement_group(group)
    assert used == {"pack": 1, "spread": 2, "strict_spread": 2}
    wait_for_cpus(ray, 4)


def replica_actors(ray) -> list[dict]:
    from ray._private.state import actors  # no dashboard here, so not `ray.util.state`

    return [a for a in actors().values() if a["ActorClassName"] == "ReplicaSupervisor" and a["State"] == "ALIVE"]


def replica_process(actor: dict) -> psutil.Process:
    """The replica a supervisor actor runs: its worker's child (every node is this machine)."""
    (child,) = [c for c in psutil.Process(actor["Pid"]).children() if "cadenza.cluster.replica_server" in c.cmdline()]
    return child


def listening(proc: psutil.Process) -> tuple[str, int]:
    (address,) = [c.laddr for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    return address.ip, address.port


def where_replicas_run(ray, server: ServerProcess) -> list[tuple[str, str]]:
    """(node id, the host its replica listens on) a replica, each where the server is connected."""
    places = [(a["Address"]["NodeID"], listening(replica_process(a))) for a in replica_actors(ray)]
    connected = {(c.raddr.ip, c.raddr.port) for c in psutil.Process(server.proc.pid).net_connections(kind="tcp")
                 if c.status == psutil.CONN_ESTABLISHED and c.raddr}  # fmt: skip
    assert {address for _, address in places} <= connected, (places, connected)
    return sorted((node, host) for node, (host, _) in places)


def single_engine_completions(model) -> list[str]:
    """The same prompts, greedy, on one engine in this process, configured as each replica is."""
    values = {"model.path": str(model), "model.dtype": "float32", "model.cpu_kernels": "off", "model.num_threads": 1,
              "cache.num_blocks": 160}  # fmt: skip
    return greedy_texts(values, PROMPTS, MAX_TOKENS)


def replica_gauge(url: str, name: str) -> dict[str, float]:
    """`cadenza_replica_<name>` per replica, from /metrics."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"cadenza_replica_{name}{{"):
            labels, value = line.rsplit(" ", 1)
            values[labels.split('replica="')[1].split('"')[0]] = float(value)
    return values


class Stream:
    """One streaming completion read on a thread: how many outputs came, and the error event that
    ended it, if one did."""

    def __init__(self, url: str, model: str, prompt: list[int]) -> None:
        self.tokens = 0  # output events (a replica may merge a few tokens into one)
        self.error: dict | None = None
        self.started, self.done = threading.Event(), threading.Event()
        self.enough = threading.Event()  # the test has seen what it needs: stop reading
        body = {"model": model, "prompt": prompt, "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        self.error = event["error"]
                        break
                    self.tokens += 1
                    self.started.set()
                    if self.enough.is_set():
                        break
        finally:
            self.done.set()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny random Llama-3 of the other tests (tests/tiny_models.py), with a longer context."""
    return build_tiny_model(tmp_path_factory.mktemp("llama3-long"), "llama3", max_position_embeddings=CONTEXT)


def test_dp2_on_two_ray_nodes_serves_like_one_engine_and_a_lost_node_fails_only_its_requests(cluster, model):
    import ray

    expected = single_engine_completions(model)
    head, second = node_named(ray, "cadenza_head"), node_named(ray, "cadenza_second")
    assert second["NodeManagerAddress"] == SECOND_NODE_IP != head["NodeManagerAddress"]
    started = time.monotonic()
    server = ServerProcess(["--model", str(model), "--dtype", "float32", "--data-parallel-size", "2"],
                           env={**SERVE_ENV, "RAY_ADDRESS": cluster.address}, timeout=90)  # fmt: skip
    replicas: list[psutil.Process] = []
    try:
        print(f"server and 2 replicas on 2 Ray nodes ready in {time.monotonic() - started:.1f} s")
        # Ray placed one replica on each node: the head's listens on loopback (the server's own
        # machine), the second node's on that node's address, and the server is connected to both.
        places = where_replicas_run(ray, server)
        assert places == sorted([(head["NodeID"], "127.0.0.1"), (second["NodeID"], SECOND_NODE_IP)]), places
        replicas = [replica_process(a) for a in replica_actors(ray)]
        on_second = replica_process(next(a for a in replica_actors(ray) if a["Address"]["NodeID"] == second["NodeID"]))

        # Greedy completions through both replicas (round robin) equal one engine's.
        name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": name, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert [c["text"] for c in sorted(reply.json()["choices"], key=lambda c: c["index"])] == expected
        assert replica_gauge(server.url, "routed") == {"0": 2, "1": 2}

        # One request on each replica; then the second node goes away, its replica with it.
        streams = [Stream(server.url, name, [7 + i, 8, 9]) for i in range(2)]
        for stream in streams:
            assert stream.started.wait(30), "a stream produced no token"
        lost = time.monotonic()
        cluster.remove_node(next(n for n in cluster.worker_nodes), allow_graceful=False)
        deadline = time.monotonic() + 20
        while not any(s.done.is_set() for s in streams) and time.monotonic() < deadline:
            time.sleep(0.05)
        failed = [s for s in streams if s.done.is_set()]
        assert len(failed) == 1, [(s.tokens, s.error) for s in streams]  # one ended; it failed, typed:
        assert failed[0].error is not None and failed[0].error["code"] == "engine_failed", failed[0].error
        (survivor,) = [s for s in streams if s is not failed[0]]
        print(f"node removed; its replica's request failed {time.monotonic() - lost:.2f} s after the removal began, "
              f"after {failed[0].tokens} outputs; the other's had {survivor.tokens}")
        at_failure = survivor.tokens
        deadline = time.monotonic() + 20
        while survivor.tokens < at_failure + 5 and not survivor.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert survivor.tokens >= at_failure + 5 and survivor.error is None, "the other replica stopped serving"
        survivor.enough.set()
        assert psutil.wait_procs([on_second], timeout=15)[1] == [], "the lost node's replica outlived it"
        assert httpx.get(f"{server.url}/health").status_code == 200  # one replica serves, one is restarting

        # Ray places the lost bundle again where it fits (the head's second CPU) and restarts the
        # actor there; the server reconnects and routes to it again.
        deadline, declared_dead = time.monotonic() + 75, None  # 15 to 33 s here
        while sum(replica_gauge(server.url, "restarts").values()) < 1:
            assert time.monotonic() < deadline, "the lost replica did not come back"
            if declared_dead is None and not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == second["NodeID"]):
                declared_dead = round(time.monotonic() - lost, 1)
            time.sleep(0.25)
        print(f"the lost replica served again on the head {time.monotonic() - lost:.1f} s after its node was removed "
              f"(Ray declared the node dead after {declared_dead} s)")
        assert where_replicas_run(ray, server) == [(head["NodeID"], "127.0.0.1")] * 2
        replicas += [replica_process(a) for a in replica_actors(ray)]
        routed = replica_gauge(server.url, "routed")
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": name, "prompt": PROMPTS[:2], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert [c["text"] for c in sorted(reply.json()["choices"], key=lambda c: c["index"])] == expected[:2]
        assert all(replica_gauge(server.url, "routed")[i] == routed[i] + 1 for i in ("0", "1"))
    except BaseException:
        print("".join(server.lines[-40:]))
        raise
    finally:
        code = server.stop()
    assert code == 0, "".join(server.lines[-20:])
    assert psutil.wait_procs(replicas, timeout=15)[1] == [], "a replica outlived its server"
    assert replica_actors(ray) == []  # the server killed its actors on the way out
    print(f"whole test {time.monotonic() - started:.1f} s after the server started")
    assert time.monotonic() - started < BOUND_SECONDS
