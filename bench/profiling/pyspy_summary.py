"""Summarise a py-spy raw profile of a cadenza run: where the samples fall, by part of the engine.

    .venv/bin/py-spy record --format raw --rate 100 -o /tmp/cadenza.txt -- \
        .venv/bin/python -m cadenza.bench.cli throughput --num-requests 16 --no-quiet-check
    .venv/bin/python -m cadenza.bench.profiling.pyspy_summary /tmp/cadenza.txt

Each sample is filed under the innermost frame that is cadenza's own code (torch's C++ time shows
as the cadenza line that called it) and under a part: the model step, the actors, the event loop.
py-spy drops idle threads by default, so the samples are time something was running.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

_PARTS = (  # first match, searching the stack from the innermost frame out
    ("samplers/", "model step: sampling"),
    ("attention_backends/", "model step: attention"),
    ("models/llama.py", "model step: decoder layers (matmuls, norms, rotary)"),
    ("models/rotary.py", "model step: decoder layers (matmuls, norms, rotary)"),
    ("runner/model_runner.py", "model step: packing, logits, runner"),
    ("actors/runner.py", "runner actor"),
    ("actors/scheduler_core.py", "scheduler (policy)"),
    ("actors/scheduler.py", "scheduler actor"),
    ("actors/cache_manager.py", "cache manager"),
    ("actors/detokenizer.py", "detokenizer"),
    ("actors/ingress.py", "ingress (validate, tokenize)"),
    ("models/tokenizer.py", "tokenizer"),
    ("models/gguf", "model load (GGUF)"),
    ("models/loading.py", "model load"),
    ("engine/streams.py", "request streams"),
    ("engine/async_engine.py", "engine"),
    ("bench/", "bench driver"),
)


def _file_of(frame: str) -> str:
    # "function (path/to/file.py:123)"
    inside = frame.rsplit("(", 1)[-1].rstrip(")")
    return inside.rsplit(":", 1)[0]


def _is_ours(path: str) -> bool:
    return "/site-packages/" not in path and "/lib/python3" not in path and path.endswith(".py")


def summarise(path: Path, top: int = 25) -> str:
    parts, frames, total = Counter(), Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        chain = stack.split(";")
        ours = [f for f in reversed(chain) if _is_ours(_file_of(f))]
        leaf = ours[0] if ours else None
        part = "other (imports, interpreter, libraries)"
        for frame in ours:
            hit = next((name for key, name in _PARTS if key in _file_of(frame)), None)
            if hit:
                part = hit
                break
        else:
            if any("asyncio" in f or "anyio" in f for f in chain):
                part = "event loop (asyncio/anyio) outside cadenza code"
        parts[part] += n
        frames[_short(leaf) if leaf else "(no cadenza frame) " + _short(chain[-1])] += n
    out = [f"{total} samples"]
    out.append("\nby part:")
    out += [f"  {100 * n / total:5.1f}%  {name}" for name, n in parts.most_common()]
    out.append(f"\ninnermost cadenza frame (top {top}):")
    out += [f"  {100 * n / total:5.1f}%  {name}" for name, n in frames.most_common(top)]
    return "\n".join(out)


def _short(frame: str) -> str:
    func, _, where = frame.partition(" (")
    file = where.rstrip(")")
    for marker in ("/work/main/", "site-packages/"):
        if marker in file:
            file = file.split(marker, 1)[1]
    return f"{func} ({file})"


if __name__ == "__main__":
    print(summarise(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 25))
