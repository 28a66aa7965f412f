"""`cadenza bench throughput|latency|serve`: the argument parser and its runner.

Wired into `cadenza` by `add_bench_parser(commands)` and `run_bench(args)`; runnable alone as
`python -m cadenza.bench.cli throughput ...`. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

from cadenza.bench.common.setup import ENGINE_FLAG_NOTES, ENGINE_FLAGS, setup_process

PEERS = ("hf", "llamacpp")
HF_VARIANTS = ("generate", "compiled", "continuous")  # what --compare hf runs
SERVE_PROTOCOLS = ("ws", "http")
WORKLOADS = ("nano-vllm",)
SERVE_WORKLOADS = ("random", "multi-turn", "disaggregation", "kv-tiers")
ROUTERS = ("prefix", "round_robin", "least_loaded")  # parallel.router's choices (cluster/router.py)
# The conversation flags' defaults per workload: kv-tiers' make a working set about 4x its --kv-blocks 176.
CONVERSATION_DEFAULTS = {
    "multi-turn": {"conversations": 16, "system_prompts": 4, "system_len": 256, "turns": 4, "user_len": (24, 40)},
    "kv-tiers": {"conversations": 16, "system_prompts": 4, "system_len": 640, "turns": 6, "user_len": (64, 96),
                 "output_len": (16, 16)},
}


def _add_common(parser: argparse.ArgumentParser, peers: bool = True) -> None:
    """The options every bench shares; `peers=False` leaves out those for peer engines."""
    parser.add_argument("--model", help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--shape", help="instead of --model: a shipped shape (llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, ...) "
                                        "as a random-weight GGUF with the default model's tokenizer, quantized by "
                                        "llama.cpp's llama-quantize and cached outside the repository (bench/peers/gguf_shapes.py)")
    parser.add_argument("--quant", help="--shape's type: F16 or a llama-quantize type (Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, "
                                        "IQ4_XS, ...); default Q4_K_M")
    parser.add_argument("--shape-layers", type=int, help="--shape's first N decoder layers only: the real layer shapes, "
                                                           "fewer of them, for a model too large for the machine "
                                                           "(qwen3-30b-a3b is 61 GB as F16)")
    parser.add_argument("--config", help="deployment YAML file for cadenza's engine settings")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-threads", type=int, help="torch (and llama.cpp) threads; default: torch's")
    parser.add_argument("--quantization", choices=["auto", "none", "int8"],
                        help="cadenza's model.quantization: run a GGUF's blocks natively (auto) or de-quantize (none)")
    parser.add_argument("--seed", type=int, default=0, help="workload and engine seed")
    parser.add_argument("--temperature", type=float, default=0.6)
    if peers:
        parser.add_argument("--compare", nargs="+", default=[], choices=PEERS, metavar="PEER",
                            help=f"peers to run the same work through, in this process: {', '.join(PEERS)}")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    parser.add_argument("--quiet-threshold", type=float, default=5.0,
                        help="other processes' CPU share, in percent, above which a run is repeated (default 5)")
    parser.add_argument("--max-repeats", type=int, default=2, help="repeats of a disturbed run (default 2)")
    parser.add_argument("--max-wait", type=float, default=30.0,
                        help="seconds to wait for a busy machine to calm down before each run (default 30)")
    parser.add_argument("--no-quiet-check", action="store_true", help="measure other processes' CPU but never wait or repeat")
    if peers:
        parser.add_argument("--gguf-cache", type=Path,
                            help="where re-written GGUFs for llama.cpp go (default ~/.cache/cadenza/bench)")
        parser.add_argument("--llamacpp-precisions", nargs="+", default=["file", "Q8_0"], metavar="P",
                            choices=["file", "Q8_0", "BF16"],
                            help="files llama.cpp runs: 'file' (the GGUF at its own precision), Q8_0, BF16 "
                                 "(re-writes of it); default: file Q8_0")
        parser.add_argument("--llamacpp-parallel", type=int, default=32,
                            help="llama-server's --parallel in the throughput workload (default 32)")
    parser.add_argument("--verbose", action="store_true", help="show the engine's logs")


def _add_device(parser: argparse.ArgumentParser) -> None:
    """Where cadenza runs and how its engine is sized; peers run on the same device."""
    from cadenza.config.flags import add_config_flags

    add_config_flags(parser, ENGINE_FLAGS, ENGINE_FLAG_NOTES)
    parser.add_argument("--hf-variants", nargs="+", choices=HF_VARIANTS, metavar="V",
                        help="what --compare hf runs: generate (plain), compiled (static cache + torch.compile "
                             "reduce-overhead), continuous (generate_batch; throughput only); default: all three "
                             "on CUDA, generate and continuous on the CPU")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add `bench` and its subcommands to `cadenza`'s subparsers; returns the `bench` parser."""
    bench = subparsers.add_parser("bench", help="measure throughput and latency against peers and this machine's ceilings")
    commands = bench.add_subparsers(dest="bench_command", required=True)

    tp = commands.add_parser("throughput", help="a seeded offline workload (nano-vllm's bench) through cadenza and peers")
    tp.add_argument("--workload", choices=WORKLOADS,
                    help="nano-vllm: its bench.py's exact requests (256, prompts and outputs uniform in 100..1024 "
                         "tokens, token ids in 0..10000, ignore_eos; --seed 0 gives its 133,966 output tokens)")
    tp.add_argument("--num-requests", type=int, help="default 64")
    tp.add_argument("--prompt-len", type=int, nargs=2, metavar=("A", "B"), help="prompt lengths uniform in [A, B] (default 32 512)")
    tp.add_argument("--output-len", type=int, nargs=2, metavar=("C", "D"), help="output lengths uniform in [C, D] (default 32 256)")
    tp.add_argument("--hf-batch-size", type=int, default=32, help="requests per static transformers batch")
    _add_common(tp)
    _add_device(tp)

    lat = commands.add_parser("latency", help="batch-1 decode, prefill and batch-N decode against the machine's ceilings")
    lat.add_argument("--prefill-lens", type=int, nargs="+", default=[128, 512, 1024], metavar="L")
    lat.add_argument("--decode-prompt-len", type=int, default=32)
    lat.add_argument("--decode-tokens", type=int, default=64, help="decode tokens timed per request")
    lat.add_argument("--batch-size", type=int, default=32, help="the large-batch decode's batch")
    lat.add_argument("--repeats", type=int, default=3, help="best of this many per measurement")
    lat.add_argument("--read-mib", type=int, default=512,
                     help="size of the tensor the memory bandwidth is measured on (read on the CPU, copied on a GPU)")
    lat.add_argument("--no-model-step", action="store_true", help="skip timing cadenza's model step without the engine")
    _add_common(lat)
    _add_device(lat)

    spr = commands.add_parser("spread", help="batch-1 decode in fresh processes, alternating with fresh llama-bench "
                                             "runs: min, median and max of each")
    spr.add_argument("--processes", type=int, default=10, help="fresh processes per engine (default 10)")
    spr.add_argument("--decode-prompt-len", type=int, default=32)
    spr.add_argument("--decode-tokens", type=int, default=64, help="decode tokens timed per request")
    spr.add_argument("--repeats", type=int, default=3, help="best of this many in each process")
    spr.add_argument("--compare", nargs="*", default=["llamacpp"], choices=["llamacpp"], metavar="PEER",
                     help="llamacpp (default): llama-bench on the same file, same threads; none with --compare alone")
    _add_common(spr, peers=False)

    srv = commands.add_parser("serve", help="a cadenza server under Poisson load over WebSocket and OpenAI HTTP, "
                                            "next to the same work offline")
    srv.add_argument("--url", help="an already running server on this machine, e.g. http://127.0.0.1:8000 "
                                   "(default: launch `cadenza serve` on a free loopback port)")
    srv.add_argument("--api-key", help="the --url server's API key")
    srv.add_argument("--protocols", nargs="+", default=list(SERVE_PROTOCOLS), choices=SERVE_PROTOCOLS,
                     help="ws: WebSocket sessions at /v1/sessions; http: streaming /v1/completions (default: both)")
    srv.add_argument("--request-rates", type=float, nargs="+", metavar="RATE",
                     help="Poisson arrival rates in requests/s, one run each; inf sends all at once (default: 1 4 inf; "
                          "multi-turn: one rate, default 2; kv-tiers: one, default 8)")
    srv.add_argument("--max-concurrency", type=int, nargs="+", metavar="N",
                     help="run each rate once per N, at most N requests in flight (at rate inf: N streams back to "
                          "back, guidellm's concurrent profile); default: no cap")
    srv.add_argument("--num-requests", type=int, default=32)
    srv.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("A", "B"), help="prompt lengths uniform in [A, B]")
    srv.add_argument("--output-len", type=int, nargs=2, metavar=("C", "D"),
                     help="output lengths uniform in [C, D] (default 32 128; multi-turn: 32 32; kv-tiers: 16 16)")
    mt = srv.add_argument_group("multi-turn", "--workload multi-turn: chats over shared system prompts against "
                                "`cadenza serve --data-parallel-size N`, one launched server per router (WebSocket, token ids)")
    mt.add_argument("--workload", choices=SERVE_WORKLOADS, default="random",
                    help="random: independent random prompts (default); multi-turn: the router bench; "
                         "disaggregation: 1 prefill + 1 decode replica against 2 colocated ones; kv-tiers: the KV "
                         "budget alone against it over a disk tier, multi-turn (the conversation flags) with a "
                         "working set several times the budget")
    mt.add_argument("--routers", nargs="+", default=["prefix", "round_robin"], choices=ROUTERS, metavar="ROUTER",
                    help=f"parallel.router of each arm: {', '.join(ROUTERS)}; ratios are the first over the second "
                         "(default: prefix round_robin)")
    mt.add_argument("--data-parallel-size", type=int, default=2, help="replicas of each arm's server (default 2)")
    mt.add_argument("--conversations", type=int, help="default 16")
    mt.add_argument("--system-prompts", type=int, help="shared system prompts; conversation c has c mod K (default 4)")
    mt.add_argument("--system-len", type=int, help="tokens of each system prompt (default 256; kv-tiers: 640)")
    mt.add_argument("--turns", type=int, help="turns per conversation (default 4; kv-tiers: 6)")
    mt.add_argument("--user-len", type=int, nargs=2, metavar=("A", "B"),
                    help="user message lengths uniform in [A, B] (default 24 40; kv-tiers: 64 96)")
    mt.add_argument("--repeats", type=int, default=1, help="runs per router (or disaggregation arm), order reversed "
                                                            "every other repeat (default 1)")
    pd = srv.add_argument_group("disaggregation", "--workload disaggregation: running decodes while long prompts "
                                "arrive, on `cadenza serve --data-parallel-size 2` colocated and as 1 prefill + 1 "
                                "decode replica (bench/serving/disagg_bench.py); one rate, default 0.5")
    pd.add_argument("--decodes", type=int, default=4, help="requests decoding throughout, whose ITL is measured (default 4)")
    pd.add_argument("--decode-prompt-len", type=int, default=32, help="their prompts' tokens (default 32)")
    pd.add_argument("--decode-tokens", type=int, default=1024,
                    help="their max_tokens: they must outlast the long prompts; cancelled after them (default 1024)")
    pd.add_argument("--long-prompts", type=int, default=8, help="long prompts arriving meanwhile (default 8)")
    pd.add_argument("--long-prompt-len", type=int, default=1024, help="their tokens (default 1024)")
    pd.add_argument("--long-tokens", type=int, default=16, help="their max_tokens (default 16)")
    pd.add_argument("--connector", default="torch_distributed",
                    help="parallel.disaggregation.connector of the disaggregated arm (default torch_distributed)")
    kv = srv.add_argument_group("kv-tiers", "--workload kv-tiers: the KV budget alone and over a disk tier (a fresh "
                                "temporary directory), each on a launched `cadenza serve` (bench/serving/tiers_bench.py); "
                                "one rate, default 8; the conversation flags above size the load")
    kv.add_argument("--kv-blocks", type=int, default=176,
                    help="cache.num_blocks of every server: the KV budget both arms share (default 176: 2,816 tokens "
                         "at 16-token blocks)")
    kv.add_argument("--restart", action="store_true",
                    help="also restart a disk-tier server halfway through the conversations, and time the next turns "
                         "against a cold server without a tier")
    kv.add_argument("--restart-requests", type=int, default=8,
                    help="--restart: requests timed after it, one at a time (the next turn of the first N "
                         "conversations; default 8)")
    srv.add_argument("--max-duration", type=float, default=300.0,
                     help="seconds per run; requests unfinished by then are cancelled and counted (default 300)")
    srv.add_argument("--vocab-size", type=int, help="draw prompt token ids below this (default: the model's vocabulary, "
                                                    "read from --model; with --url and no --model, 10000)")
    srv.add_argument("--no-offline", action="store_true", help="skip the offline run of the same workload")
    srv.add_argument("--server-start-timeout", type=float, default=600.0, help="seconds the launched server may take to listen")
    _add_common(srv, peers=False)
    return bench


def run_bench(args: argparse.Namespace) -> int:
    from cadenza.config import ConfigError
    from cadenza.models.errors import ModelLoadError
    from cadenza.plugins.errors import PluginError

    try:
        resolve_shape(args)
        if args.bench_command == "throughput":
            return _throughput(args)
        if args.bench_command == "serve" and args.workload == "multi-turn":
            from cadenza.bench.serving.router_bench import serve_multi_turn

            return serve_multi_turn(args)
        if args.bench_command == "serve":
            for name, value in CONVERSATION_DEFAULTS.get(args.workload, {}).items():
                if getattr(args, name) is None:
                    setattr(args, name, value)
        if args.bench_command == "serve" and args.workload == "kv-tiers":
            from cadenza.bench.serving.tiers_bench import serve_kv_tiers

            return serve_kv_tiers(args)
        if args.bench_command == "serve" and args.workload == "disaggregation":
            from cadenza.bench.serving.disagg_bench import serve_disaggregation

            return serve_disaggregation(args)
        if args.bench_command == "serve":
            return _serve(args)
        if args.bench_command == "spread":
            return _spread(args)
        return _latency(args)
    except (ConfigError, ModelLoadError, PluginError, ValueError) as exc:
        print(f"cadenza bench: error: {exc}", file=sys.stderr)
        return 2


def resolve_shape(args: argparse.Namespace) -> None:
    """`--shape`/`--quant` as `--model`: the shape's GGUF, written and quantized on first use."""
    shape, quant, layers = getattr(args, "shape", None), getattr(args, "quant", None), getattr(args, "shape_layers", None)
    if shape is None:
        if quant is not None or layers is not None:
            raise ValueError("--quant and --shape-layers describe a --shape's GGUF; give --shape too")
        return
    if args.model is not None:
        raise ValueError("--shape writes the model the bench runs; give --model or --shape, not both")
    if getattr(args, "load_format", None) == "dummy":
        raise ValueError("--shape is a GGUF file of the shape; with --load-format dummy give the shape as --model")
    from cadenza.bench.peers.gguf_shapes import shape_gguf
    from cadenza.models.dummy import shipped_shapes

    if shape not in shipped_shapes():
        raise ValueError(f"--shape {shape!r} is not a shipped shape; shipped shapes: {', '.join(shipped_shapes())}")
    cut = "" if layers is None else f" --shape-layers {layers}"
    print(f"--shape {shape}{cut} --quant {quant or 'Q4_K_M'}: writing or finding its GGUF ...", flush=True)
    args.model = str(shape_gguf(shape, quant or "Q4_K_M", layers=layers))


def _load_engine(args: argparse.Namespace):
    from cadenza.bench.common.engines import CadenzaEngine

    overrides = {"model.seed": args.seed, "model.quantization": args.quantization}
    return CadenzaEngine(args.model, dtype=args.dtype, num_threads=args.num_threads, overrides=overrides,
                         config_path=args.config)


def _bench_engine(args: argparse.Namespace, config, arch, needs, policy):
    """cadenza's engine for `throughput` and `latency`, with the overrides `plan_engine` gives for
    `needs`; on a GPU the quiet check measures the host but never waits. Returns (engine, notes)."""
    from cadenza.bench.common.device import plan_engine
    from cadenza.bench.common.engines import CadenzaEngine

    plan = plan_engine(args, config, arch, needs)
    if plan.device.type == "cuda":
        policy.enabled = False
        plan.notes.append("quiet check: the host's other CPU load is measured, never waited for nor repeated (a GPU run)")
    engine = CadenzaEngine(args.model, dtype=args.dtype, num_threads=args.num_threads, overrides=plan.overrides,
                           config_path=args.config)
    return engine, plan.notes


def hf_variants(args: argparse.Namespace, device) -> tuple[str, ...]:
    """`--hf-variants`; by default all on CUDA, and on the CPU all but the compiled static cache
    (inductor takes a minute or more to compile on a CPU, and "reduce-overhead" is CUDA graphs)."""
    if args.hf_variants:
        return tuple(dict.fromkeys(args.hf_variants))
    return HF_VARIANTS if device.type == "cuda" else tuple(v for v in HF_VARIANTS if v != "compiled")


def _throughput(args: argparse.Namespace) -> int:
    from cadenza.bench.common.device import WorkNeeds, read_bench_config
    from cadenza.bench.common.report import environment, write_json
    from cadenza.bench.common.workload import bench_workload
    from cadenza.bench.offline.throughput import run_throughput

    policy = setup_process(args)
    config, arch = read_bench_config(args)
    workload = bench_workload(args, arch.vocab_size)
    needs = WorkNeeds(tuple(len(r.prompt_token_ids) + r.max_tokens + 1 for r in workload.requests))
    engine, notes = _bench_engine(args, config, arch, needs, policy)
    env = environment(args.num_threads, engine.device)
    print(f"cadenza bench throughput: {engine.source} ({args.dtype}) on {env['device']}, {env['machine']}, "
          f"{env['torch_threads']} threads, cadenza {env['cadenza_revision']}")
    for note in notes:
        print(f"  {note}")
    print(f"workload: {workload.describe()}")
    result = run_throughput(engine, workload, compare=args.compare, dtype=args.dtype, policy=policy,
                            hf_batch_size=args.hf_batch_size, hf_variants=hf_variants(args, engine.device),
                            load_format=config.model.load_format, num_threads=args.num_threads,
                            gguf_cache=args.gguf_cache, seed=args.seed, llamacpp_parallel=args.llamacpp_parallel,
                            llamacpp_precisions=args.llamacpp_precisions)
    print()
    print(result.render())
    if args.json:
        write_json(args.json, {"bench": "throughput", "model": engine.source, "dtype": args.dtype,
                               "load_format": config.model.load_format, "environment": env, "engine_notes": notes,
                               **result.as_dict()})
    return 0 if result.cadenza is not None and not result.cadenza.note else 1


def _latency(args: argparse.Namespace) -> int:
    from cadenza.bench.common.device import WorkNeeds, read_bench_config
    from cadenza.bench.common.quiet import run_quietly
    from cadenza.bench.common.report import environment, write_json
    from cadenza.bench.offline.ceilings import ModelCost, measure_ceilings
    from cadenza.bench.offline.latency import (
        CadenzaModelProbe,
        CadenzaProbe,
        LatencyPlan,
        add_peer_probes,
        describe_ceilings,
        render_latency,
        run_latency,
    )

    policy = setup_process(args)
    plan = LatencyPlan(tuple(args.prefill_lens), args.decode_prompt_len, args.decode_tokens, args.batch_size, args.repeats)
    config, arch = read_bench_config(args)
    needs = WorkNeeds((plan.decode_prompt_len + plan.decode_tokens + 2,) * plan.batch, alone=max(plan.prefill_lens) + 2)
    engine, notes = _bench_engine(args, config, arch, needs, policy)
    device = engine.device
    env = environment(args.num_threads, device)
    print(f"cadenza bench latency: {engine.source} ({args.dtype}) on {env['device']}, {env['machine']}, "
          f"{env['torch_threads']} threads, cadenza {env['cadenza_revision']}")
    for note in notes:
        print(f"  {note}")
    ceilings, quiet = run_quietly(lambda: measure_ceilings(read_bytes=args.read_mib << 20, device=device), policy)
    cost = ModelCost.from_arch(engine.arch, engine.dtype, engine.kv_dtype, engine.runtime.loaded.model)
    print(describe_ceilings(ceilings, cost, engine.dtype, quiet))
    probes = [CadenzaProbe(engine, args.temperature)]
    if not args.no_model_step:
        probes.append(CadenzaModelProbe(engine, args.temperature))
    skipped, weights_check = add_peer_probes(args, engine, config.model.load_format,
                                             hf_variants(args, device), probes)
    rows = run_latency(probes, plan, cost, ceilings, engine.dtype, policy, failed=skipped)
    print()
    print(render_latency(rows, ceilings, skipped))
    if args.json:
        write_json(args.json, {"bench": "latency", "model": engine.source, "dtype": args.dtype,
                               "load_format": config.model.load_format, "environment": env, "engine_notes": notes,
                               "ceilings": ceilings.as_dict(), "ceilings_quiet": quiet.as_dict(), "model_cost": cost.as_dict(),
                               "plan": {"prefill_lens": list(plan.prefill_lens), "decode_prompt_len": plan.decode_prompt_len,
                                        "decode_tokens": plan.decode_tokens, "batch": plan.batch, "repeats": plan.repeats},
                               "rows": [r.as_dict() for r in rows], "skipped": skipped, "weights_check": weights_check})
    return 0


def _spread(args: argparse.Namespace) -> int:
    import os

    from cadenza.bench.common.report import environment, write_json
    from cadenza.bench.offline.spread import SpreadPlan, render_spread, run_spread
    from cadenza.bench.peers.llamacpp import why_llamacpp_cannot_run

    if args.processes < 1:
        raise ValueError(f"--processes must be at least 1, got {args.processes}")
    policy = setup_process(args)
    if args.model is None:
        from cadenza.models.default_model import default_model_path

        args.model = str(default_model_path())
    threads = args.num_threads or os.cpu_count() or 1  # llama-bench's threads, and so cadenza's
    plan = SpreadPlan(args.processes, args.decode_prompt_len, args.decode_tokens, args.repeats, threads, args.dtype,
                      args.temperature, args.config, args.quantization)
    env = environment(threads)
    print(f"cadenza bench spread: {args.model}, batch-1 decode after {plan.prompt_len} tokens, {plan.decode_tokens} timed, "
          f"best of {plan.repeats} in each of {plan.processes} fresh processes, {threads} threads, {env['machine']}, "
          f"cadenza {env['cadenza_revision']}")
    skipped = {}
    peer_path = None
    if "llamacpp" in args.compare:
        why = why_llamacpp_cannot_run(Path(args.model))
        if why is None:
            peer_path = Path(args.model)
        else:
            skipped["llama.cpp"] = why
    spreads = run_spread(args.model, plan, policy, peer_path)
    print()
    print(render_spread(spreads))
    for name, why in skipped.items():
        print(f"  {name}: skipped ({why})")
    if args.json:
        write_json(args.json, {"bench": "spread", "model": args.model, "environment": env,
                               "plan": {"processes": plan.processes, "prompt_len": plan.prompt_len,
                                        "decode_tokens": plan.decode_tokens, "repeats": plan.repeats, "threads": threads},
                               "engines": [s.as_dict() for s in spreads], "skipped": skipped})
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Launch or find the server, load it per protocol and rate, stop it, then the offline run."""
    import contextlib
    import shlex

    from cadenza.bench.serving.serve_process import check_loopback

    url = check_loopback(args.url) if args.url else None  # refused before anything starts
    args.request_rates = args.request_rates or [1.0, 4.0, math.inf]
    if any(not rate > 0 for rate in args.request_rates):
        raise ValueError(f"--request-rates must be positive (or inf), got {args.request_rates}")
    if any(n < 1 for n in args.max_concurrency or ()):
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.max_duration <= 0:
        raise ValueError(f"--max-duration must be positive, got {args.max_duration}")
    if args.api_key and url is None:
        raise ValueError("--api-key is for a --url server; the launched server needs none")
    policy = setup_process(args)

    from cadenza.bench.common.report import environment, write_json
    from cadenza.bench.common.workload import make_workload
    from cadenza.bench.serving.serve import ServePlan, ServeTarget, run_serve
    from cadenza.bench.serving.serve_process import (
        LaunchedServer,
        get_json,
        listening_pid,
        model_vocab_size,
        run_quietly_here,
        sigterm_raises,
        wait_healthy,
    )

    knows_model = url is None or args.model is not None
    vocab = args.vocab_size or (model_vocab_size(args.model, args.config) if knows_model else 10_000)
    workload = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len or (32, 128)), seed=args.seed,
                             vocab_size=vocab, temperature=args.temperature)
    plan = ServePlan(tuple(dict.fromkeys(args.protocols)), tuple(args.request_rates), args.max_duration, args.seed,
                     vocab, tuple(dict.fromkeys(args.max_concurrency or [None])))
    env = environment(args.num_threads)
    argv = getattr(args, "argv", None) or ["cadenza", *sys.argv[1:]]
    command = shlex.join(argv)
    print(f"cadenza bench serve: {url or 'a launched cadenza serve'} ({args.dtype if url is None else 'its own config'}), "
          f"{env['machine']}, cadenza {env['cadenza_revision']}")
    print(f"command: {command}")
    print(f"workload: {workload.describe()}")

    try:
        with contextlib.ExitStack() as stack:
            if url is None:
                stack.enter_context(sigterm_raises())
                print("starting cadenza serve ...")
                server = stack.enter_context(LaunchedServer(
                    model=args.model, dtype=args.dtype, config=args.config, num_threads=args.num_threads,
                    seed=args.seed, verbose=args.verbose, start_timeout=args.server_start_timeout))
                base, pid = server.url, server.pid
                print(f"  listening on {base} (pid {pid})")
            else:
                wait_healthy(url, timeout=10)
                base, pid = url, listening_pid(url)
            model_name = get_json(base + "/v1/models", args.api_key)["data"][0]["id"]
            target = ServeTarget(base, model_name, args.api_key, pid, launched=url is None)
            result = run_serve(target, workload, plan, policy)
    except (RuntimeError, OSError) as exc:
        print(f"cadenza bench serve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cadenza bench serve: interrupted" + (" (the server was stopped)" if url is None else ""), file=sys.stderr)
        return 130
    if not knows_model and args.vocab_size is None:
        result.notes.append("prompt token ids were drawn below 10000: give --vocab-size or --model for a smaller vocabulary")

    if args.no_offline:
        result.offline_note = "skipped (--no-offline)"
    elif not knows_model:
        result.offline_note = "skipped: give --model (and --config) to compare with the same work offline"
    else:
        if url is not None:
            result.notes.append("offline: this process with --model/--config/--dtype; the server may run another config")
        print("running the saturation workload offline (after the server stopped) ...")
        try:
            engine = _load_engine(args)
            result.offline, quiet = run_quietly_here(lambda: engine.run(workload), policy)
        except Exception as exc:  # the serving results stand on their own: report them all the same
            result.offline_note = f"the offline run failed: {exc!r}"
            print(f"  offline: failed: {exc!r}", file=sys.stderr)
        else:
            result.offline.quiet = quiet
            print(f"  offline: {result.offline.output_tokens_per_second:.1f} output tok/s in "
                  f"{result.offline.seconds:.1f}s ({quiet.describe()})")
    print()
    print(result.render())
    if args.json:
        write_json(args.json, {"bench": "serve", "command": command, "model": args.model, "dtype": args.dtype,
                               "config": args.config, "environment": env, **result.as_dict()})
    return 1 if any(run.of_status("failed") for run in result.runs) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cadenza.bench.cli throughput ...`: the same as `cadenza bench throughput ...`."""
    parser = argparse.ArgumentParser(prog="cadenza", description="cadenza benchmarks")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = list(sys.argv[1:] if argv is None else argv)
    parsed = parser.parse_args(["bench", *args])
    parsed.argv = ["cadenza", "bench", *args]  # the command a report shows
    return run_bench(parsed)


if __name__ == "__main__":
    sys.exit(main())
