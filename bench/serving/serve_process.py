"""The server the serving bench talks to: a loopback URL, or a `cadenza serve` it launches itself.

Also what the quiet-machine check needs to know about that server: its process id (found from
its listening socket when the bench did not start it) and the CPU time it has used, so that the
server's work counts as the bench's own rather than as another process disturbing the run.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, TypeVar
from urllib.parse import urlsplit

from cadenza.bench.common.quiet import CpuSnapshot, QuietPolicy, QuietReport, run_quietly, take_snapshot

T = TypeVar("T")

_READY = re.compile(r"cadenza listening on (http://\S+)")


def check_loopback(url: str) -> str:
    """The URL without a trailing slash; a ValueError unless it is http(s) on a loopback address.

    The bench floods what it points at, so it only ever points at this machine.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url must look like http://127.0.0.1:PORT, got {url!r}")
    host = parts.hostname
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"--url {url!r} is not a loopback address: the serving bench only loads a server on this "
                         "machine (127.0.0.1, ::1 or localhost)")
    return url.rstrip("/")


def get_json(url: str, api_key: str | None = None, timeout: float = 10.0) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_healthy(url: str, timeout: float) -> dict:
    """`/health`'s answer once it is ok; a RuntimeError naming the last problem after `timeout`."""
    deadline = time.monotonic() + timeout
    problem = "no answer"
    while time.monotonic() < deadline:
        try:
            return get_json(url + "/health", timeout=5)
        except urllib.error.HTTPError as exc:
            problem = f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}"
        except (OSError, ValueError) as exc:
            problem = repr(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{url}/health was not ok within {timeout:.0f}s: {problem}")


def wait_idle(url: str, timeout: float = 30.0) -> bool:
    """Wait until the server runs and queues nothing (from /metrics), so that a request a
    previous run cancelled cannot slow the next one. False if it stayed busy for `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return False
        busy = [float(m.group(1)) for m in re.finditer(r"^cadenza_requests_(?:running|waiting) (\S+)$", text, re.M)]
        if not any(busy):
            return True
        time.sleep(0.1)
    return False


class LaunchedServer:
    """`cadenza serve` on a free loopback port (port 0; the server prints the real one), in its
    own process group so that stopping it stops everything it started. Use as a context
    manager: it is stopped on leaving, whatever ended the block (KeyboardInterrupt included)."""

    def __init__(self, *, model: str | None, dtype: str, config: str | None, num_threads: int | None, seed: int,
                 verbose: bool = False, start_timeout: float = 600.0, extra_args: tuple[str, ...] = (),
                 extra_env: dict[str, str] | None = None) -> None:
        args = [sys.executable, "-m", "cadenza", "serve", "--host", "127.0.0.1", "--port", "0", "--dtype", dtype]
        for flag, value in (("--model", model), ("--config", config), ("--num-threads", num_threads)):
            if value is not None:
                args += [flag, str(value)]
        args += list(extra_args)
        # The seed the offline comparison also runs with (an env var ranks above the config file).
        env = {**os.environ, "CADENZA_MODEL__SEED": str(seed), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        self.args, self.env, self.verbose, self.start_timeout = args, env, verbose, start_timeout
        self.lines: deque[str] = deque(maxlen=200)  # the server's last output, for error messages
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    def __enter__(self) -> "LaunchedServer":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, start_new_session=True)
        try:
            threading.Thread(target=self._read, daemon=True, name="cadenza-serve-output").start()
            if not self._ready.wait(self.start_timeout) or self.url is None:
                raise RuntimeError(f"cadenza serve did not start (exit code {self.proc.poll()}); its last output:\n"
                                   + "".join(self.lines))
            wait_healthy(self.url, timeout=60)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.verbose:
                sys.stderr.write(line)
            match = _READY.search(line)
            if match and self.url is None:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()  # the server exited before it listened

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the process group (the server drains, then exits), SIGKILL after `timeout`."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


@contextmanager
def sigterm_raises():
    """While inside, SIGTERM raises SystemExit in the main thread (as Ctrl-C raises
    KeyboardInterrupt), so `finally` blocks run and a launched server is stopped, not orphaned."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def listening_pid(url: str) -> int | None:
    """The process listening on the URL's port, from /proc/net/tcp{,6} and /proc/*/fd; None where
    that cannot be seen (not Linux, another user's process)."""
    port = urlsplit(url).port
    if port is None:
        return None
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(proc.name)
        except OSError:
            continue
    return None


def process_cpu_jiffies(pid: int) -> int | None:
    """utime + stime of every thread of `pid`, in jiffies, as /proc/self/stat counts the bench's own."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def group_cpu_jiffies(pgid: int) -> int | None:
    """utime + stime of every process in the process group `pgid` (a launched server and the
    replicas or ranks it started), or None where /proc cannot be read."""
    total, found = 0, False
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # after comm: state, ppid, pgrp
                total, found = total + int(fields[11]) + int(fields[12]), True
        except (OSError, ValueError, IndexError):
            continue
    return total if found else None


def model_vocab_size(model: str | None, config_path: str | None) -> int:
    """The vocabulary of the model `cadenza serve --model M --config C` would load, read from its
    config alone (no weights), so the workload draws only token ids the server accepts."""
    from cadenza.config import load_config
    from cadenza.models.default_model import default_model_path

    config = load_config(config_path, overrides={"model.path": model})
    path = default_model_path() if config.model.path is None else Path(config.model.path).expanduser()
    if path.suffix == ".gguf":
        from cadenza.models.gguf_loader import open_gguf, read_gguf_config

        return read_gguf_config(open_gguf(path), str(path)).vocab_size
    from cadenza.models.hf_loader import read_hf_config

    return read_hf_config(path).vocab_size


def _snapshot(server_pid: int | None) -> CpuSnapshot | None:
    snap = take_snapshot()
    server = None
    if server_pid is not None:  # a launched server leads its own group: its replicas' CPU is the bench's too
        server = group_cpu_jiffies(server_pid) if _leads_group(server_pid) else process_cpu_jiffies(server_pid)
    if snap is None or server is None:
        return snap
    return dataclasses.replace(snap, own=snap.own + server)


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def run_quietly_here(fn: Callable[[], T], policy: QuietPolicy, server_pid: int | None = None
                     ) -> tuple[T, QuietReport]:
    """`quiet.run_quietly`, with `fn` run on this thread rather than the compute thread, and the
    server's CPU (when given) counted as the bench's own: a serving run is the bench and its
    server together.

    On this thread, an engine run has the server's layout: the event loop here, model steps on the
    compute thread, overlapping. On the compute thread the loop would wait for every step (about
    4% slower on 2 cores), which would flatter the serving overhead.
    A disturbed run is repeated up to `max_repeats` times; the least disturbed attempt is kept.
    """
    return run_quietly(fn, policy, on_compute_thread=False, snapshot=lambda: _snapshot(server_pid))
