"""Start the real `cadenza serve` on a free loopback port; always stop it by its process group."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

_READY = re.compile(r"cadenza listening on (http://\S+)")


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, timeout: float = 120.0) -> None:
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url: str | None = None
        env = dict(env or {})
        if "PYTHONPATH" in env:  # a plugin's folder goes in front of the caller's path, never instead of it
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [env["PYTHONPATH"], os.environ.get("PYTHONPATH")]))
        full_env = {**os.environ, "CADENZA_LOGGING__FORMAT": "json", "PYTHONUNBUFFERED": "1", **env}
        full_env.pop("CADENZA_CONFIG", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cadenza", "serve", "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            start_new_session=True,  # its own process group: stopping it stops everything it started
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-40:]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = _READY.search(line)
            if match:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()

    @property
    def ws_url(self) -> str:
        assert self.url
        return self.url.replace("http://", "ws://") + "/v1/sessions"

    def log_events(self, event: str) -> list[str]:
        return [line for line in self.lines if f'"event": "{event}"' in line]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._reader.join(5)
        return self.proc.returncode


@contextmanager
def running_server(model: Path, *extra: str, env: dict[str, str] | None = None):
    server = ServerProcess(["--model", str(model), "--dtype", "float32", *extra], env=env)
    try:
        yield server
    finally:
        server.stop()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
