"""`cadenza bench throughput|latency`: the argument parser and its runner.

Wired into `cadenza` by `add_bench_parser(commands)` and `run_bench(args)`; runnable alone as
`python -m cadenza.bench.cli throughput ...`. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

PEERS = ("hf", "llamacpp")


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--config", help="deployment YAML file for cadenza's engine settings")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-threads", type=int, help="torch (and llama.cpp) threads; default: torch's")
    parser.add_argument("--seed", type=int, default=0, help="workload and engine seed")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--compare", nargs="+", default=[], choices=PEERS, metavar="PEER",
                        help=f"peers to run the same work through, in this process: {', '.join(PEERS)}")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    parser.add_argument("--quiet-threshold", type=float, default=5.0,
                        help="other processes' CPU share, in percent, above which a run is repeated (default 5)")
    parser.add_argument("--max-repeats", type=int, default=2, help="repeats of a disturbed run (default 2)")
    parser.add_argument("--max-wait", type=float, default=30.0,
                        help="seconds to wait for a busy machine to calm down before each run (default 30)")
    parser.add_argument("--no-quiet-check", action="store_true", help="measure other processes' CPU but never wait or repeat")
    parser.add_argument("--gguf-cache", type=Path, help="where the bf16 GGUF for llama.cpp is written (default ~/.cache/cadenza/bench)")
    parser.add_argument("--verbose", action="store_true", help="show the engine's logs")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add `bench` and its subcommands to `cadenza`'s subparsers; returns the `bench` parser."""
    bench = subparsers.add_parser("bench", help="measure throughput and latency against peers and this machine's ceilings")
    commands = bench.add_subparsers(dest="bench_command", required=True)

    tp = commands.add_parser("throughput", help="a seeded offline workload (nano-vllm's bench) through cadenza and peers")
    tp.add_argument("--num-requests", type=int, default=64)
    tp.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("A", "B"), help="prompt lengths uniform in [A, B]")
    tp.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("C", "D"), help="output lengths uniform in [C, D]")
    tp.add_argument("--hf-batch-size", type=int, default=32, help="requests per static transformers batch")
    _add_common(tp)

    lat = commands.add_parser("latency", help="batch-1 decode, prefill and batch-N decode against the machine's ceilings")
    lat.add_argument("--prefill-lens", type=int, nargs="+", default=[128, 512, 1024], metavar="L")
    lat.add_argument("--decode-prompt-len", type=int, default=32)
    lat.add_argument("--decode-tokens", type=int, default=64, help="decode tokens timed per request")
    lat.add_argument("--batch-size", type=int, default=32, help="the large-batch decode's batch")
    lat.add_argument("--repeats", type=int, default=3, help="best of this many per measurement")
    lat.add_argument("--read-mib", type=int, default=512, help="size of the tensor the memory read rate is measured on")
    lat.add_argument("--no-model-step", action="store_true", help="skip timing cadenza's model step without the engine")
    _add_common(lat)
    return bench


def run_bench(args: argparse.Namespace) -> int:
    from cadenza.config import ConfigError
    from cadenza.models.errors import ModelLoadError
    from cadenza.plugins.errors import PluginError

    try:
        if args.bench_command == "throughput":
            return _throughput(args)
        return _latency(args)
    except (ConfigError, ModelLoadError, PluginError, ValueError) as exc:
        print(f"cadenza bench: error: {exc}", file=sys.stderr)
        return 2


def _setup(args: argparse.Namespace):
    """Logging, the quiet-machine policy and cadenza's engine, loaded."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # progress shows as it happens, even in a file
    from cadenza.bench.engines import CadenzaEngine
    from cadenza.bench.quiet import QuietPolicy
    from cadenza.logging_setup import configure_logging

    configure_logging("info" if args.verbose else "warning", "console")
    policy = QuietPolicy(threshold=args.quiet_threshold / 100, max_repeats=args.max_repeats,
                         max_wait_seconds=args.max_wait, enabled=not args.no_quiet_check)
    overrides = {"model.seed": args.seed}
    engine = CadenzaEngine(args.model, dtype=args.dtype, num_threads=args.num_threads, overrides=overrides,
                           config_path=args.config)
    return engine, policy


def _throughput(args: argparse.Namespace) -> int:
    from cadenza.bench.report import environment, write_json
    from cadenza.bench.throughput import run_throughput
    from cadenza.bench.workload import make_workload

    engine, policy = _setup(args)
    workload = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), seed=args.seed,
                             vocab_size=engine.arch.vocab_size, temperature=args.temperature)
    env = environment(args.num_threads)
    print(f"cadenza bench throughput: {engine.source} ({args.dtype}), {env['machine']}, {env['torch_threads']} threads, "
          f"cadenza {env['cadenza_revision']}")
    print(f"workload: {workload.describe()}")
    result = run_throughput(engine, workload, compare=args.compare, dtype=args.dtype, policy=policy,
                            hf_batch_size=args.hf_batch_size, num_threads=args.num_threads,
                            gguf_cache=args.gguf_cache, seed=args.seed)
    print()
    print(result.render())
    if args.json:
        write_json(args.json, {"bench": "throughput", "model": engine.source, "dtype": args.dtype,
                               "environment": env, **result.as_dict()})
    return 0 if result.cadenza is not None and not result.cadenza.note else 1


def _latency(args: argparse.Namespace) -> int:
    import torch

    from cadenza.bench.ceilings import ModelCost, measure_ceilings
    from cadenza.bench.latency import CadenzaModelProbe, CadenzaProbe, LatencyPlan, run_latency
    from cadenza.bench.quiet import run_quietly
    from cadenza.bench.report import environment, percent, table, write_json

    engine, policy = _setup(args)
    env = environment(args.num_threads)
    print(f"cadenza bench latency: {engine.source} ({args.dtype}), {env['machine']}, {env['torch_threads']} threads, "
          f"cadenza {env['cadenza_revision']}")
    ceilings, quiet = run_quietly(lambda: measure_ceilings(read_bytes=args.read_mib << 20), policy)
    cost = ModelCost.from_arch(engine.arch, engine.dtype, engine.kv_dtype)
    c = ceilings.as_dict()
    print(f"ceilings: memory read {c['memory_read_GBps']} GB/s, matmul bf16 {c['matmul_bf16_GFLOPps']} GFLOP/s, "
          f"fp32 {c['matmul_fp32_GFLOPps']} GFLOP/s (F.linear {'x'.join(map(str, ceilings.matmul_shape))}) ({quiet.describe()})")
    print(f"model: {cost.weight_bytes / 1e6:.0f} MB of weights read per decode step, "
          f"{cost.decode_flops(0) / 1e6:.0f} MFLOP per token")
    read_ms = 1e3 * cost.weight_bytes / ceilings.memory_bandwidth
    flop_ms = 1e3 * cost.decode_flops(0) / ceilings.matmul_bf16 if engine.dtype != torch.float32 \
        else 1e3 * cost.decode_flops(0) / ceilings.matmul_fp32
    print(f"predicted batch-1 decode step: weights / bandwidth {read_ms:.1f} ms, FLOPs / {str(engine.dtype).removeprefix('torch.')} "
          f"matmul rate {flop_ms:.1f} ms; prefill: {1e3 * cost.prefill_flops(512) / ceilings.matmul(engine.dtype) / 512:.2f} ms per "
          f"token at 512 (best matmul rate)")
    plan = LatencyPlan(tuple(args.prefill_lens), args.decode_prompt_len, args.decode_tokens, args.batch_size, args.repeats)
    probes = [CadenzaProbe(engine, args.temperature)]
    if not args.no_model_step:
        probes.append(CadenzaModelProbe(engine, args.temperature))
    skipped = _latency_peers(args, engine, plan, probes)
    rows = run_latency(probes, plan, cost, ceilings, engine.dtype, policy)
    print()
    print(table(
        ["measure", "engine", "tok/s", "ceiling tok/s", "achieved", "% bf16 mm", "% fp32 mm", "machine"],
        [[r.measure, r.engine, r.tokens_per_second, r.ceiling_tokens_per_second,
          percent(r.tokens_per_second, r.ceiling_tokens_per_second),
          percent(r.model_flops, ceilings.matmul_bf16), percent(r.model_flops, ceilings.matmul_fp32),
          r.quiet.describe() if r.quiet else "-"] for r in rows],
    ))
    for name, why in skipped.items():
        print(f"  {name}: skipped ({why})")
    print("  ceiling: decode = weight (+KV) bytes / memory read rate, or FLOPs / matmul rate if slower; "
          "prefill = FLOPs / matmul rate; for bf16 weights the faster of the bf16 and fp32 (exact upcast) rates")
    print("  % bf16 mm, % fp32 mm: the large-batch decode's model FLOP/s over each matmul rate")
    if args.json:
        write_json(args.json, {"bench": "latency", "model": engine.source, "dtype": args.dtype, "environment": env,
                               "ceilings": c, "ceilings_quiet": quiet.as_dict(), "model_cost": cost.as_dict(),
                               "plan": {"prefill_lens": list(plan.prefill_lens), "decode_prompt_len": plan.decode_prompt_len,
                                        "decode_tokens": plan.decode_tokens, "batch": plan.batch, "repeats": plan.repeats},
                               "rows": [r.as_dict() for r in rows], "skipped": skipped})
    return 0


def _latency_peers(args, engine, plan, probes) -> dict[str, str]:
    skipped: dict[str, str] = {}
    if "hf" in args.compare:
        from cadenza.bench.latency import HFProbe
        from cadenza.bench.peers import load_hf_model

        try:
            probes.append(HFProbe(load_hf_model(engine.source, args.dtype), args.temperature))
        except Exception as exc:
            skipped["hf"] = f"transformers could not load {engine.source}: {exc}"
    if "llamacpp" in args.compare:
        from cadenza.bench.latency import LlamaCppProbe
        from cadenza.bench.llamacpp import LlamaCppEngine, bf16_gguf_for, llama_cpp_available
        from cadenza.bench.throughput import default_gguf_cache

        source = Path(engine.source)
        if not llama_cpp_available():
            skipped["llama.cpp"] = "llama-cpp-python is not installed (pip install llama-cpp-python)"
        elif source.suffix != ".gguf":
            skipped["llama.cpp"] = "needs a .gguf model"
        else:
            path = bf16_gguf_for(source, args.gguf_cache or default_gguf_cache())
            max_len = max(*plan.prefill_lens, plan.decode_prompt_len + plan.decode_tokens) + 16
            llama = LlamaCppEngine(path, num_threads=args.num_threads, max_len=max_len, seed=args.seed)
            probes.append(LlamaCppProbe(llama, args.temperature, engine.arch.vocab_size))
    return skipped


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cadenza.bench.cli throughput ...`: the same as `cadenza bench throughput ...`."""
    parser = argparse.ArgumentParser(prog="cadenza", description="cadenza benchmarks")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = list(sys.argv[1:] if argv is None else argv)
    return run_bench(parser.parse_args(["bench", *args]))


if __name__ == "__main__":
    sys.exit(main())
