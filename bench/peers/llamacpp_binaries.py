"""llama.cpp's own binaries as a latency peer: `llama-bench` and `llama-batched-bench` on a GGUF file.

This is how llama.cpp's users measure it, on the file at its own precision (the embedded model is
Q4_1) and on a Q8_0 re-write of it: `LlamaBinaryProbe` answers the latency bench's questions by
running the binaries (built once by `python -m cadenza.bench.peers.llamacpp_build`) and reading their
JSON. Each call loads the model afresh (about 0.1 s for the default model) and measures one run
after llama-bench's own warm-up; the latency bench keeps the best of its repeats, as for cadenza.

- prefill L: `llama-bench -p L -n 0` (a prompt of L tokens in one batch);
- batch-1 decode after a prompt of P tokens: `llama-bench -p 0 -n N -d P` (N tokens generated one by
  one after a P-token context);
- batch-B decode: `llama-batched-bench -npp P -ntg N -npl B` (B sequences of P prompt tokens, then N
  tokens each, decoded together); its text-generation rate over all sequences.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from cadenza.bench.peers.llamacpp_build import find_binary, why_binaries_missing

_TIMEOUT_S = 600


class LlamaBinaryError(RuntimeError):
    """A llama.cpp binary failed or printed something other than its results; the message has its stderr."""


def _run_json(command: list[str]) -> list[dict]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT_S)
    if done.returncode != 0:
        raise LlamaBinaryError(f"{Path(command[0]).name} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    text = done.stdout.strip()
    try:
        if text.startswith("["):
            return json.loads(text)
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    except json.JSONDecodeError as exc:
        raise LlamaBinaryError(f"{Path(command[0]).name} printed no JSON ({exc}): {text[-500:]}") from exc


class LlamaBinaryProbe:
    """One GGUF file through llama.cpp's binaries; `kind` (e.g. "Q4_1") names the file's precision."""

    def __init__(self, gguf_path: Path, kind: str, num_threads: int) -> None:
        bench, batched = find_binary("llama-bench"), find_binary("llama-batched-bench")
        if bench is None or batched is None:
            raise LlamaBinaryError(why_binaries_missing() or "llama.cpp binaries are not built")
        self.path, self.threads, self.bench, self.batched = gguf_path, num_threads, bench, batched
        self.name = f"llama.cpp {kind}"

    def _llama_bench(self, prompt: int, generate: int, depth: int, repeats: int = 1) -> dict:
        rows = _run_json([str(self.bench), "-m", str(self.path), "-t", str(self.threads), "-r", str(repeats), "-o", "json",
                          "-p", str(prompt), "-n", str(generate), "-d", str(depth)])
        if len(rows) != 1:
            raise LlamaBinaryError(f"llama-bench returned {len(rows)} results, expected 1")
        return rows[0]

    def prefill_seconds(self, length: int, seed: int) -> float:
        return self._llama_bench(length, 0, 0)["avg_ns"] / 1e9

    def best_decode_rate(self, prompt_len: int, num_tokens: int, repeats: int) -> float:
        """Batch-1 decode in one fresh llama-bench process: the best of its `repeats` runs (tok/s)."""
        row = self._llama_bench(0, num_tokens, prompt_len, repeats)
        return float(max(row.get("samples_ts") or [row["avg_ts"]]))

    def decode_tokens_per_second(self, batch: int, prompt_len: int, num_tokens: int, seed: int) -> float | None:
        if batch == 1:
            return float(self._llama_bench(0, num_tokens, prompt_len)["avg_ts"])
        context = batch * (prompt_len + num_tokens) + 256
        rows = _run_json([str(self.batched), "-m", str(self.path), "-t", str(self.threads), "-c", str(context),
                          "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(num_tokens),
                          "-npl", str(batch), "--output-format", "jsonl"])
        if len(rows) != 1:
            raise LlamaBinaryError(f"llama-batched-bench returned {len(rows)} results, expected 1")
        return float(rows[0]["speed_tg"])
