"""llama.cpp's own server as a throughput peer: `llama-server` on a GGUF file, loaded over loopback.

This is how llama.cpp's users batch: `llama-server --parallel N` runs N slots with continuous
batching over one model. `LlamaServerEngine.run(workload)` launches it on a free loopback port
(the binary built by `python -m cadenza.bench.peers.llamacpp_build`), posts every request of the
workload at once to `/completion` as token ids (`n_predict` = the request's output length,
`ignore_eos`, its temperature and a per-request seed, no prompt cache), times the first submission
to the last answer, and stops the server by its process id, even when a request fails.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from cadenza.bench.common.engines import EngineRun
from cadenza.bench.common.workload import Workload
from cadenza.bench.peers.llamacpp_build import find_binary, why_binaries_missing

_START_TIMEOUT_S = 120
_REQUEST_TIMEOUT_S = 1800


class LlamaServerError(RuntimeError):
    """llama-server did not start, or answered a request with an error; the message says which."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServerEngine:
    def __init__(self, gguf_path: Path, kind: str, *, num_threads: int, parallel: int, max_len: int, seed: int = 0) -> None:
        binary = find_binary("llama-server")
        if binary is None:
            raise LlamaServerError(why_binaries_missing() or "llama-server is not built")
        self.binary, self.path, self.kind = binary, gguf_path, kind
        self.threads, self.parallel, self.max_len, self.seed = num_threads, parallel, max_len, seed
        self.name = f"llama.cpp {kind} (llama-server, {parallel} parallel)"
        self.last_pid: int | None = None  # the server of the latest run (stopped when `run` returns)

    def _command(self, port: int) -> list[str]:
        # Each slot gets ctx / parallel positions; room for the longest request in every slot.
        context = self.parallel * (-(-self.max_len // 256) * 256)
        return [str(self.binary), "-m", str(self.path), "--host", "127.0.0.1", "--port", str(port),
                "-t", str(self.threads), "-tb", str(self.threads), "-c", str(context), "-np", str(self.parallel),
                "-cb", "-b", "2048", "-ub", "512", "--no-webui", "--seed", str(self.seed)]

    def run(self, workload: Workload) -> EngineRun:
        import httpx

        port = _free_port()
        process = subprocess.Popen(self._command(port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   start_new_session=True)
        self.last_pid = process.pid
        try:
            base = f"http://127.0.0.1:{port}"
            self._wait_healthy(process, base, httpx)
            self._post_all(base, workload, workload.requests[:1], warmup=True)  # warm up
            started = time.perf_counter()
            produced = self._post_all(base, workload, workload.requests)
            seconds = time.perf_counter() - started
        finally:
            self._stop(process)
        return EngineRun(engine=self.name, seconds=seconds, num_prompt_tokens=workload.num_prompt_tokens,
                         num_output_tokens=produced, num_computed_tokens=produced,
                         note=f"llama-server --parallel {self.parallel} on {self.path.name}, /completion with token ids")

    def _wait_healthy(self, process: subprocess.Popen, base: str, httpx) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise LlamaServerError(f"llama-server exited {process.returncode}: "
                                       f"{process.stderr.read().decode(errors='replace')[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise LlamaServerError(f"llama-server was not healthy after {_START_TIMEOUT_S}s")

    def _post_all(self, base: str, workload: Workload, requests, warmup: bool = False) -> int:
        import httpx

        async def post(client: httpx.AsyncClient, index: int, request) -> int:
            body = {"prompt": list(request.prompt_token_ids), "n_predict": 4 if warmup else request.max_tokens,
                    "ignore_eos": True, "temperature": workload.temperature, "seed": self.seed * 100_003 + index,
                    "cache_prompt": False, "stream": False}
            response = await client.post(base + "/completion", json=body)
            if response.status_code != 200:
                raise LlamaServerError(f"llama-server answered {response.status_code}: {response.text[:500]}")
            return int(response.json()["tokens_predicted"])

        async def main() -> int:
            limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=len(requests) + 1)
            async with httpx.AsyncClient(timeout=_REQUEST_TIMEOUT_S, limits=limits) as client:
                counts = await asyncio.gather(*(post(client, i, r) for i, r in enumerate(requests)))
            return sum(counts)

        return asyncio.run(main())

    @staticmethod
    def _stop(process: subprocess.Popen) -> None:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if process.stderr is not None:
            process.stderr.close()
