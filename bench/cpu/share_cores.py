"""`python -m cadenza.bench.cpu.share_cores`: the engine beside a busy neighbour, per thread binding.

docs/cpu-threads.md's workload (16 requests of 32 tokens, greedy, `ignore_eos`, on a loaded `LLM()`)
timed end to end in fresh processes, each `model.thread_binding` setting in turn (processes
alternating, so drift hits every setting), first alone and then beside a neighbour started in a
session of its own (as a user's other program runs) and stopped by its process group:

- `llama-bench`: llama.cpp's `llama-bench -t <cores> -p 0 -n 512` on the same GGUF, repeated (the
  every-CPU issue's neighbour; built by `python -m cadenza.bench.peers.llamacpp_build`);
- `omp-spin`: torch with `OMP_WAIT_POLICY=ACTIVE` and a team of every core, running matrix-vector
  products in a loop (a llama-bench-like neighbour that needs no build).

Prints each setting's times alone and beside the neighbour, and the ratio of their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

_NUM_REQUESTS, _MAX_TOKENS = 16, 32
_OMP_SPIN = ("import torch, os; torch.set_num_threads(len(os.sched_getaffinity(0))); w, x = torch.randn(4096, 2048), "
             "torch.randn(2048); [torch.mv(w, x) for _ in iter(int, 1)]")  # fmt: skip


def _child(binding: str, runs: int) -> None:
    """One process: load, warm up, then `runs` timed passes of the workload; prints their seconds."""
    from cadenza import LLM, SamplingParams

    with LLM(**{"logging.level": "warning", "model.thread_binding": binding}) as llm:
        params = SamplingParams(temperature=0, max_tokens=_MAX_TOKENS, ignore_eos=True)
        prompts = [f"Write a short story about the number {i}." for i in range(_NUM_REQUESTS)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        seconds = []
        for _ in range(runs):
            started = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds.append(round(time.perf_counter() - started, 3))
    print(json.dumps(seconds))


def _neighbour(kind: str) -> subprocess.Popen:
    if kind == "omp-spin":
        env = {**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}
        command = [sys.executable, "-c", _OMP_SPIN]
    else:
        from cadenza.bench.peers.llamacpp_build import find_binary, why_binaries_missing
        from cadenza.models.default_model import default_model_path

        why = why_binaries_missing()
        if why:
            raise SystemExit(why)
        cores = str(len(os.sched_getaffinity(0)))
        command = [str(find_binary("llama-bench")), "-m", str(default_model_path()), "-t", cores, "-p", "0", "-n", "512",
                   "-r", "100000"]  # fmt: skip
        env = dict(os.environ)
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


def _without_openmp_binding() -> dict[str, str]:
    """This environment less OpenMP's binding variables, under which `auto` would pin nothing."""
    from cadenza.threads.binding import USER_BINDING

    return {k: v for k, v in os.environ.items() if k not in {var.name for var in USER_BINDING}}


def _runs(settings: list[str], processes: int, runs: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {s: [] for s in settings}
    for _ in range(processes):
        for setting in settings:
            done = subprocess.run([sys.executable, "-m", "cadenza.bench.cpu.share_cores", "--child", setting, "--runs", str(runs)],
                                  env=_without_openmp_binding(), capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
            times[setting] += json.loads(done.stdout.strip().splitlines()[-1])
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cadenza.bench.cpu.share_cores", description=__doc__.splitlines()[0])
    parser.add_argument("--neighbour", choices=("llama-bench", "omp-spin"), default="llama-bench")
    parser.add_argument("--settings", nargs="+", default=["auto", "none"], help="model.thread_binding values.")
    parser.add_argument("--processes", type=int, default=4, help="Fresh processes a setting, beside the neighbour.")
    parser.add_argument("--runs", type=int, default=3, help="Timed passes a process.")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.runs)
        return 0

    from cadenza.bench.common.quiet import describe_machine, measure_other_cpu

    busy = measure_other_cpu(1.0)
    print(f"# {describe_machine()}; other processes used {busy if busy is None else round(busy, 2)} of the CPU before the runs")
    alone = _runs(args.settings, 1, args.runs)
    neighbour = _neighbour(args.neighbour)
    try:
        time.sleep(2)  # past the neighbour's start-up
        beside = _runs(args.settings, args.processes, args.runs)
    finally:
        _stop(neighbour)
    print(f"neighbour: {args.neighbour}; seconds for {_NUM_REQUESTS} requests of {_MAX_TOKENS} tokens")
    for setting in args.settings:
        ratio = statistics.median(beside[setting]) / statistics.median(alone[setting])
        print(f"thread_binding {setting}: alone {alone[setting]}, beside {beside[setting]} "
              f"(median {statistics.median(beside[setting]):.2f} s, {ratio:.2f}x alone)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
