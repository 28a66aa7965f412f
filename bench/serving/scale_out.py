"""Scale-out on this machine: tensor parallelism's step time and its communication, data
parallelism's throughput, and cache-aware routing against round-robin.

    python -m cadenza.bench.serving.scale_out [--model PATH] [--quick]

1. TP=2 against TP=1 (with the machine's threads, and with one, as each TP=2 rank has): mean decode step (batch 1 and 8) and one prefill step, with rank 0's time in
   collectives (broadcasts, all-reduces, the logits gather; waiting for the slower rank included)
   split from the rest, and the bytes rank 0 moved per token.
2. DP=2 x 1 thread against DP=1 x 2 threads: output tokens per second on one batch of requests.
3. A multi-session workload (sessions of several turns, each prompt the last one, its reply and a
   new turn) on DP=2 with the prefix router and with round-robin: prefix-cache hit rate, throughput.

Numbers depend on the cores free: the machine's other load is reported beside them.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import anyio

from cadenza.config import CadenzaConfig, load_config


def _config(model: str | None, **overrides) -> CadenzaConfig:
    values = {"cache.num_blocks": 512, "logging.level": "warning", **overrides}
    if model is not None:
        values["model.path"] = model
    return load_config(None, overrides=values, env={})


# --- 1. tensor parallelism ----------------------------------------------------------------------


def tensor_parallel(model: str | None, steps: int) -> dict:
    from cadenza.parallel.tensor_parallel import comm_stats
    from cadenza.runtime.build import build_runtime
    from cadenza.sampling_params import SamplingParams
    from cadenza.step import ScheduledChunk
    from cadenza.threads import compute_thread

    results = {}
    # TP=1 with the machine's threads, TP=1 with one thread (what each TP=2 rank gets), TP=2.
    for name, tp, threads in (("tp1", 1, None), ("tp1_1thread", 1, 1), ("tp2", 2, None)):
        runtime = build_runtime(_config(model, **{"parallel.tensor_parallel_size": tp, "model.num_threads": threads}))
        try:
            params = SamplingParams(temperature=0)
            rng = random.Random(0)

            def run(chunks):
                return compute_thread.run_sync(runtime.runner.execute, chunks)

            row = {}
            for batch in (1, 8):
                prompts = [[rng.randrange(100, 10000) for _ in range(32)] for _ in range(batch)]
                tables = [list(range(i * 8, i * 8 + 8)) for i in range(batch)]
                tag = f"b{batch}-{tp}"
                result = run([ScheduledChunk(f"{tag}-{i}", p, 0, tables[i], True, params, p) for i, p in enumerate(prompts)])
                tokens = result.sampled.token_ids.tolist()
                comm_stats.reset()
                started = time.perf_counter()
                for step in range(steps):
                    chunks = [ScheduledChunk(f"{tag}-{i}", [t], 32 + step, tables[i], True, params, prompts[i])
                              for i, t in enumerate(tokens)]  # fmt: skip
                    tokens = run(chunks).sampled.token_ids.tolist()
                total = (time.perf_counter() - started) / steps
                comm = comm_stats.seconds / steps
                row[f"decode_batch{batch}"] = {"step_ms": round(total * 1e3, 2), "comm_ms": round(comm * 1e3, 2),
                                               "compute_ms": round((total - comm) * 1e3, 2),
                                               "bytes_per_token": round(comm_stats.bytes / (steps * batch))}  # fmt: skip
                compute_thread.run_sync(runtime.runner.finish_requests, [f"{tag}-{i}" for i in range(batch)])
            prompt = [rng.randrange(100, 10000) for _ in range(256)]
            comm_stats.reset()
            started = time.perf_counter()
            run([ScheduledChunk(f"prefill-{tp}", prompt, 0, list(range(100, 117)), True, params, prompt)])
            total = time.perf_counter() - started
            row["prefill_256"] = {"step_ms": round(total * 1e3, 1), "comm_ms": round(comm_stats.seconds * 1e3, 1),
                                  "compute_ms": round((total - comm_stats.seconds) * 1e3, 1),
                                  "bytes_per_token": round(comm_stats.bytes / 256)}  # fmt: skip
            results[name] = row
        finally:
            runtime.close()
    return results


# --- 2 and 3. data parallelism ------------------------------------------------------------------


async def _run_batch(engine, prompts, max_tokens: int) -> tuple[int, float]:
    from cadenza.sampling_params import SamplingParams

    generated = 0
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def one(prompt):
        nonlocal generated
        async for out in engine.generate(prompt, params):
            generated += len(out.token_ids)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for prompt in prompts:
            tg.start_soon(one, prompt)
    return generated, time.perf_counter() - started


def data_parallel(model: str | None, requests: int, max_tokens: int) -> dict:
    from cadenza.cluster.dp_engine import DataParallelEngine
    from cadenza.cluster.replicas import start_replicas

    rng = random.Random(1)
    prompts = [[rng.randrange(100, 10000) for _ in range(rng.randrange(16, 64))] for _ in range(requests)]
    results = {}
    # DP=1 x 1 thread too: on a busy machine a 2-thread OpenMP team can lose far more to spinning
    # than it gains, and this row tells that apart from what the second replica brings.
    for dp, threads in ((1, 2), (1, 1), (2, 1)):
        runtime = start_replicas(_config(model, **{"parallel.data_parallel_size": dp, "model.num_threads": threads}))
        try:
            async def scenario():
                async with DataParallelEngine.serve(runtime) as engine:
                    await _run_batch(engine, prompts[:2], 4)  # warm-up
                    return await _run_batch(engine, prompts, max_tokens)

            generated, seconds = anyio.run(scenario)
            results[f"dp{dp}x{threads}threads"] = {"output_tok_per_s": round(generated / seconds, 1), "seconds": round(seconds, 2)}
        finally:
            runtime.close()
    return results


def routing(model: str | None, sessions: int, turns: int, max_tokens: int) -> dict:
    from cadenza.cluster.dp_engine import DataParallelEngine
    from cadenza.cluster.replicas import start_replicas
    from cadenza.cluster.router import Router
    from cadenza.sampling_params import SamplingParams

    runtime = start_replicas(_config(model, **{"parallel.data_parallel_size": 2, "model.num_threads": 1}))
    results = {}
    try:
        for n, policy in enumerate(("prefix", "round_robin")):
            rng = random.Random(100 + n)  # fresh sessions per policy: the other's cache does not help

            async def scenario():
                cached = total = generated = 0
                params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                async with DataParallelEngine.serve(runtime) as engine:
                    engine.router = Router(2, runtime.block_size, policy, capacity_blocks=runtime.num_blocks)

                    async def session():
                        nonlocal cached, total, generated
                        prompt = [rng.randrange(100, 10000) for _ in range(160)]  # a session's system prompt
                        for _ in range(turns):
                            reply, last = [], None
                            async for out in engine.generate(prompt, params):
                                reply += out.token_ids
                                last = out
                            cached += last.num_cached_tokens
                            total += last.num_prompt_tokens
                            generated += len(reply)
                            prompt = prompt + reply + [rng.randrange(100, 10000) for _ in range(24)]

                    started = time.perf_counter()
                    async with anyio.create_task_group() as tg:
                        for _ in range(sessions):
                            tg.start_soon(session)
                    seconds = time.perf_counter() - started
                return {"prefix_hit_rate": round(cached / total, 3), "output_tok_per_s": round(generated / seconds, 1),
                        "prompt_tok_per_s": round(total / seconds, 1), "seconds": round(seconds, 2)}  # fmt: skip

            results[policy] = anyio.run(scenario)
    finally:
        runtime.close()
    return results


def main(argv=None) -> int:
    from cadenza.bench.common.quiet import measure_other_cpu
    from cadenza.config.logging_setup import configure_logging

    parser = argparse.ArgumentParser(prog="python -m cadenza.bench.serving.scale_out", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF directory or .gguf (default: the embedded SmolLM2-135M Q4_1 GGUF)")
    parser.add_argument("--quick", action="store_true", help="fewer steps and requests")
    parser.add_argument("--only", choices=["tp", "dp", "routing"], help="run one part")
    args = parser.parse_args(argv)
    configure_logging("warning", "console")
    quick = args.quick
    report: dict = {"other_cpu_share_before": measure_other_cpu(1.0)}
    if args.only in (None, "tp"):
        report["tensor_parallel"] = tensor_parallel(args.model, steps=10 if quick else 40)
    if args.only in (None, "dp"):
        report["data_parallel"] = data_parallel(args.model, requests=8 if quick else 32, max_tokens=16 if quick else 48)
    if args.only in (None, "routing"):
        report["routing"] = routing(args.model, sessions=4 if quick else 8, turns=3 if quick else 4, max_tokens=8 if quick else 16)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
