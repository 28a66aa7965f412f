"""`python -m cadenza.bench.features.step_rows`: what one more row costs in a model step.

A speculative step verifies k guesses as a chunk of k + 1 rows over the request's cached prompt, so
its price is the model step's time against its rows. This times `ModelRunner.execute` on chunks of
1, 2, 4, 8, 16 rows at a fixed context (on the compute thread, as the engine runs it), best of
`--repeats`, and prints each size's time and its ratio to one row. Run it as each kind of CPU
(`CADENZA_CPU=avx2 ...`) to see where speculation's extra rows are cheap.
"""

from __future__ import annotations

import argparse
import time

from cadenza.bench.common.workload import random_prompt
from cadenza.bench.offline.model_step import _chunk


def time_rows(runtime, sizes: list[int], context: int, repeats: int, calls: int = 5) -> dict[int, float]:
    """Seconds of a step of each size in `sizes`: a chunk of that many rows at position `context`
    of one sequence (rewritten in place each call), best of `repeats` means over `calls` calls."""
    from cadenza.sampling_params import SamplingParams
    from cadenza.threads.compute_thread import run_sync

    runner, block_size = runtime.runner, runtime.block_size
    params = SamplingParams(temperature=0, max_tokens=max(sizes) + 1, ignore_eos=True)
    prompt = random_prompt(context + max(sizes), seed=1, vocab_size=runtime.loaded.arch.vocab_size)
    table = list(range(-(-len(prompt) // block_size)))
    if len(table) > runtime.num_blocks:
        raise ValueError(f"the context needs {len(table)} KV blocks, the cache has {runtime.num_blocks}")

    def measure() -> dict[int, float]:
        runner.execute([_chunk("rows", prompt[:context], 0, table, params, prompt)])
        best: dict[int, float] = {}
        for size in sizes:
            chunk = _chunk("rows", prompt[context : context + size], context, table, params, prompt)
            runner.execute([chunk])  # warm
            for _ in range(repeats):
                started = time.perf_counter()
                for _ in range(calls):
                    runner.execute([chunk])
                best[size] = min(best.get(size, float("inf")), (time.perf_counter() - started) / calls)
        return best

    return run_sync(measure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cadenza.bench.features.step_rows", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="Model path (default: the embedded SmolLM2 GGUF).")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=300, help="Tokens cached before the chunk.")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    from cadenza.kernels.cpu.loader import isa
    from cadenza.llm import LLM

    with LLM(args.model, max_model_len=args.context + max(args.sizes) + 16, **{"logging.level": "warning"}) as llm:
        seconds = time_rows(llm.runtime, args.sizes, args.context, args.repeats)
    one = seconds[min(seconds)]
    print(f"kernels: {isa()}; context {args.context} tokens; a step of n rows (ms, and against {min(seconds)} row):")
    print("  ".join(f"{n}: {s * 1e3:.2f} ({s / one:.2f}x)" for n, s in seconds.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
