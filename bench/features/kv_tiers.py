"""The disk tier across a restart: time to first token of a long prompt computed, then sent again
by a restarted engine that reads its prefix back from disk (docs/kv-tiers.md).

    python -m cadenza.bench.features.kv_tiers --model PATH --tokens 4000

Prints one JSON line: the two TTFTs, their ratio, and the disk tier's counters. The issue's target
on the 1B shape (CPU): the restarted TTFT >= 20x sooner.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path


def first_token_seconds(llm, tokens: list[int]) -> tuple[float, int]:
    """(seconds to the first token of a one-token greedy request, prompt tokens it found cached)."""
    from cadenza import SamplingParams

    started = time.perf_counter()
    (out,) = llm.generate({"prompt_token_ids": tokens}, SamplingParams(temperature=0.0, max_tokens=1))
    return time.perf_counter() - started, out.num_cached_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cadenza.bench.features.kv_tiers",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--model", default=None, help="model path (default: the embedded model)")
    parser.add_argument("--tokens", type=int, default=4000, help="prompt length")
    parser.add_argument("--disk-path", default=None, help="the disk tier's directory (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from cadenza import LLM

    with tempfile.TemporaryDirectory() as scratch:
        disk = args.disk_path or str(Path(scratch) / "kv")
        with LLM(args.model, kv_disk_path=disk) as llm:
            vocab = llm.runtime.loaded.arch.vocab_size
            tokens = random.Random(args.seed).choices(range(100, min(vocab, 30000)), k=args.tokens)
            computed, _ = first_token_seconds(llm, tokens)
            agent = next(a for a in llm.engine.actors if a.name == "kv_tiers")
            while agent._writes or agent._queued:  # let write-behind finish before the "restart"
                time.sleep(0.05)
        with LLM(args.model, kv_disk_path=disk) as llm:
            restored, cached = first_token_seconds(llm, tokens)
            stats = llm.engine.metrics.kv_tiers["disk"]
            print(json.dumps({
                "prompt_tokens": args.tokens, "ttft_computed_s": round(computed, 4),
                "ttft_from_disk_s": round(restored, 4), "speedup": round(computed / restored, 2),
                "cached_tokens": cached, "disk_hits": stats.hits,
                "disk_bytes_read": stats.bytes_read, "disk_read_s": round(stats.read_seconds, 4),
            }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
