"""Two "nodes" on loopback: two torchrun processes, one rank each, meet through a c10d rendezvous
and serve one model split over them (TP=2), as two machines would (docs/scale-out.md, "Two machines
with torchrun"). Node 0 hosts the rendezvous store and, its address sorting first, gets rank 0: it
serves HTTP; node 1's rank runs its shard. Both are stopped by their process groups, whatever happens.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import psutil
import pytest
from single_engine import greedy_texts

from cadenza.parallel.groups import free_port

TORCHRUN = Path(sys.executable).parent / "torchrun"
PROMPTS = [[5, 6, 7, 8, 9], [30, 31, 32], list(range(100, 121))]
MAX_TOKENS = 8
# c10d orders the nodes by their address: node 0's sorts first, so it gets rank 0 (and the server).
NODE_ADDRESSES = ("127.0.0.1", "127.0.0.2")


def node_command(node: int, rendezvous_port: int, model: Path) -> list[str]:
    """What one machine of two runs (docs/scale-out.md), with loopback for the network."""
    return [
        str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rendezvous_port}", "--rdzv-id", "cadenza-test",
        "--rdzv-conf", f"is_host={int(node == 0)},join_timeout=60", "--local-addr", NODE_ADDRESSES[node],
        "-m", "cadenza", "serve", "--tensor-parallel-size", "2", "--model", str(model), "--dtype", "float32",
        "--host", "127.0.0.1", "--port", "0",
    ]  # fmt: skip


class Node:
    """One torchrun process in a process group of its own, its output collected."""

    def __init__(self, node: int, command: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "CADENZA_LOGGING__FORMAT": "json", "GLOO_SOCKET_IFNAME": "lo",
               "CADENZA_PARALLEL__TIMEOUT_SECONDS": "20"}  # fmt: skip
        env.pop("CADENZA_CONFIG", None)
        self.node = node
        self.lines: list[str] = []
        self.url: str | None = None
        self.listening = threading.Event()
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)  # fmt: skip
        threading.Thread(target=self._read, daemon=True, name=f"node{node}").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "cadenza listening on " in line and self.url is None:
                self.url = line.split("cadenza listening on ")[1].strip()
                self.listening.set()
        self.listening.set()  # it exited: whoever waits stops waiting

    def rank(self) -> psutil.Process:
        (child,) = psutil.Process(self.proc.pid).children()
        return child

    def stop(self, grace: float = 15.0) -> None:
        """SIGINT to its whole process group (torchrun and its rank), SIGKILL after `grace`."""
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        try:  # a rank that outlived its torchrun is in the same group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self) -> str:
        return f"--- node {self.node} ---\n" + "".join(self.lines[-30:])


def children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def single_process_completions(model: Path) -> list[str]:
    """The same prompts, greedy, on one engine in this process (TP=1)."""
    values = {"model.path": str(model), "model.dtype": "float32", "cache.num_blocks": 64}
    return greedy_texts(values, PROMPTS, MAX_TOKENS)


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
def test_two_torchrun_nodes_serve_tp2_like_one_engine_and_a_dead_rank_fails_health(tiny_model_dir):
    model = tiny_model_dir("llama3")
    # First: it also builds the CPU kernels when a source changed (tens of seconds on a busy machine),
    # which the nodes would otherwise each wait for, past the rendezvous's timeout.
    expected = single_process_completions(model)
    started = time.monotonic()
    rendezvous = free_port()
    with ExitStack() as cleanup:
        nodes = []
        for n in (0, 1):
            nodes.append(Node(n, node_command(n, rendezvous, model)))
            cleanup.callback(nodes[-1].stop)
        try:
            assert nodes[0].listening.wait(60) and nodes[0].url, "rank 0 never served"
            url = nodes[0].url
            assert nodes[1].url is None  # node 1's rank runs its shard, it serves nothing
            assert any('"rank": 1' in line and "Tensor-parallel rank ready" in line for line in nodes[1].lines)

            reply = httpx.post(f"{url}/v1/completions", timeout=30, json={
                "model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"], "prompt": PROMPTS,
                "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            })  # fmt: skip
            assert reply.status_code == 200, reply.text
            choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
            assert [c["text"] for c in choices] == expected
            assert reply.json()["usage"]["completion_tokens"] == MAX_TOKENS * len(PROMPTS)

            # Rank 1 dies (node 1 lost): rank 0's next collective (a heartbeat while idle) fails,
            # and /health names the rank. Node 0's torchrun keeps its rank: it hosts the store.
            rank1 = nodes[1].rank()
            rank1.kill()
            deadline = time.monotonic() + 20
            while (health := httpx.get(f"{url}/health")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert health.status_code == 503, health.text
            assert "rank 1" in health.text, health.text
            assert nodes[1].proc.wait(15) != 0  # torchrun reports its failed rank and exits
        except BaseException:
            print("".join(node.tail() for node in nodes), file=sys.stderr)
            raise
        finally:
            ranks = [child for node in nodes for child in children(node.proc.pid)]
    # Every torchrun and every rank is gone.
    assert all(node.proc.poll() is not None for node in nodes)
    gone, alive = psutil.wait_procs(ranks, timeout=5)
    assert not alive, alive
    assert time.monotonic() - started < 90
