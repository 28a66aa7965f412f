"""One interface for every process cadenza starts beside itself: a tensor-parallel rank, a
data-parallel replica, a replica on Ray. Each starts, reports ready, fails and stops the same way.

    handle.start()                      # returns at once
    address = handle.wait_ready(60.0)   # blocks until it serves (again, after a restart)
    handle.is_alive()                   # cheap: safe on an event loop's thread
    handle.stop(grace=10.0)             # ask, wait `grace`, then kill; idempotent

`LocalProcess` is a child process of this one (ranks and local replicas); `ray_replicas.RayReplica`
is a replica a Ray actor supervises on some node. Neither imports anything of cadenza's engine.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

from cadenza.parallel.errors import ParallelError


@dataclass(frozen=True, slots=True)
class Address:
    """Where a started process serves, and what it reported with it."""

    host: str
    port: int
    num_blocks: int = 0  # a replica's KV-cache blocks
    pid: int | None = None  # the serving process, on its own machine


class ManagedProcess(ABC):
    """A process cadenza started and answers for. `name` appears in every error and log line
    ("tensor-parallel rank 1", "data-parallel replica 0"); `restarts`: whether one that dies comes
    back by itself (a Ray actor with restarts left), so that waiting for it is worth it."""

    name: str
    restarts: bool = False
    address: Address | None = None  # the last one `wait_ready` returned

    @abstractmethod
    def start(self) -> None:
        """Begin starting it; returns at once."""

    @abstractmethod
    def wait_ready(self, timeout: float) -> Address:
        """Block until it serves and return where. After it died, a handle that `restarts` waits
        for the next incarnation. Raises the handle's `ParallelError` when it died for good, or
        did not come within `timeout` seconds."""

    @abstractmethod
    def is_alive(self) -> bool:
        """Whether it still runs (False before it was ready, between restarts, after stop)."""

    @abstractmethod
    def kill(self) -> None:
        """End it now, without asking (one that `restarts` comes back)."""

    @abstractmethod
    def stop(self, grace: float) -> None:
        """Ask it to leave, wait up to `grace` seconds, then kill it. Idempotent; never restarts."""

    def failure(self) -> str | None:
        """Why it cannot serve, or None while it can."""
        return None if self.is_alive() else f"{self.name} is not running"


class LocalProcess(ManagedProcess):
    """A child process on this machine. It dies with this process (PR_SET_PDEATHSIG on Linux).

    `ready`: a pattern with groups host, port and blocks that the child prints on stdout once it
    serves (a replica). Without it the child reports ready elsewhere (a rank: at the process
    group's barrier), and `wait_ready` returns `address` while it runs. `lifeline`: its stdin is a
    pipe from this process, whose end tells it that this process is gone, whichever thread started
    it (a Ray actor's)."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], *, ready: re.Pattern | None = None,
        address: Address | None = None, error: type[ParallelError] = ParallelError, lifeline: bool = False,
    ) -> None:  # fmt: skip
        self.name = name
        self.argv, self.env = argv, env
        self.ready, self.address, self.error = ready, address, error
        self.lifeline = lifeline
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.argv, env=self.env, text=True,
            stdin=subprocess.PIPE if self.lifeline else subprocess.DEVNULL,
            # No ready line: its stdout goes to our stderr (fd 2), never to a pipe nobody reads.
            stdout=subprocess.PIPE if self.ready else 2,
            preexec_fn=die_with_parent,
        )  # fmt: skip

    def wait_ready(self, timeout: float) -> Address:
        if self.process is None:
            raise self.error(f"{self.name} was never started")
        if self.ready is None or self.address is not None and self.address.pid == self.process.pid:
            if self.process.poll() is not None:
                raise self.error(f"{self.name} exited with status {self.process.returncode}")
            return self.address
        found: list[re.Match] = []

        def read() -> None:
            for line in self.process.stdout:
                match = self.ready.search(line)
                if match:
                    found.append(match)
                    break
            self.process.stdout.close()  # it prints nothing more

        reader = threading.Thread(target=read, daemon=True, name=f"ready:{self.name}")
        reader.start()
        reader.join(timeout)
        if not found:
            raise self.error(f"{self.name} did not start (status {self.process.poll()})")
        match = found[0]
        self.address = Address(match["host"], int(match["port"]), int(match["blocks"]), self.process.pid)
        return self.address

    def exit_status(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def failure(self) -> str | None:
        code = self.exit_status()
        return None if code is None else f"{self.name} exited with status {code}"

    def wait_exit(self, timeout: float) -> int | None:
        """Its exit status once it has left by itself within `timeout`, else None."""
        if self.process is None:
            return 0
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.is_alive():
            self.process.kill()
            self.process.wait()

    def stop(self, grace: float) -> None:
        if not self.is_alive():
            return
        self.process.terminate()
        if self.wait_exit(grace) is None:
            self.kill()


def die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the parent dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def exit_with_stdin() -> None:
    """In a child started with `lifeline`: SIGTERM itself once its stdin ends (its parent is gone)."""
    import os
    import signal

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(1 << 12):
                pass
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="lifeline").start()
