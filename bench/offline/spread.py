"""Batch-1 decode over fresh processes: does every process decode at the same speed?

A decode rate measured in one process can sit in a fast or a slow mode for the whole life of the
process (a 1B Q4_K_M file on a Zen 5 gave 58.5, 49.3, 59.4, 58.1, 48.7 and 46.3 tok/s in six fresh
processes). `run_spread` starts `processes` fresh cadenza processes, alternating with as many
fresh `llama-bench` runs on the same file when llama.cpp is built, and reports each engine's min,
median and max and the slowest over the fastest. Each cadenza process is this module run with
`--child`: it loads the model, decodes `repeats` times (best kept, as `bench latency` does) and
prints one JSON line with its rates and what the process looked like (huge pages holding the
weights, each compute thread's CPU ticks and the CPU it last ran on), so that a slow process can
be told from a fast one by more than its speed.

    cadenza bench spread --shape llama-3.2-1b --quant Q4_K_M --processes 10 --num-threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cadenza.bench.common.quiet import QuietPolicy, QuietReport, run_quietly

_CHILD_TIMEOUT_S = 900


@dataclass(frozen=True, slots=True)
class SpreadPlan:
    processes: int = 10
    prompt_len: int = 32
    decode_tokens: int = 64
    repeats: int = 3  # best of, within each process
    num_threads: int | None = None
    dtype: str = "bfloat16"
    temperature: float = 0.6
    config: str | None = None  # a deployment YAML for the engine's settings
    quantization: str | None = None  # model.quantization


@dataclass(slots=True)
class EngineSpread:
    """One engine's best rate in each fresh process, in the order they ran."""

    engine: str
    rates: list[float] = field(default_factory=list)
    details: list[dict] = field(default_factory=list)
    quiet: list[QuietReport] = field(default_factory=list)

    def quiet_rates(self) -> list[float]:
        """The rates of the rounds the machine stayed quiet through (all of them if none did): a
        round another process disturbed says nothing about this engine's own spread."""
        kept = [r for r, q in zip(self.rates, self.quiet) if q.is_quiet is not False]
        return kept or list(self.rates)

    def summary(self) -> dict:
        rates = self.quiet_rates()
        if not rates:
            return {"engine": self.engine, "processes": 0}
        low, high = min(rates), max(rates)
        return {"engine": self.engine, "processes": len(rates), "disturbed": len(self.rates) - len(rates),
                "min": round(low, 2), "median": round(statistics.median(rates), 2), "max": round(high, 2),
                "slowest_over_fastest": round(low / high, 4)}

    def as_dict(self) -> dict:
        return {**self.summary(), "rates": [round(r, 2) for r in self.rates], "details": self.details,
                "quiet": [q.as_dict() for q in self.quiet]}


def _thread_ticks() -> dict[int, tuple[int, int]]:
    """Each thread of this process: (utime + stime in clock ticks, the CPU it last ran on)."""
    ticks = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        ticks[int(task.name)] = (int(fields[11]) + int(fields[12]), int(fields[36]))
    return ticks


def _proc_kib(path: str, key: str) -> int | None:
    """The kB figure of `key` ("VmRSS", "AnonHugePages") in a /proc file of this process, or None."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _resident_kib() -> int | None:
    return _proc_kib("/proc/self/status", "VmRSS")


def _anon_huge_kib() -> int | None:
    return _proc_kib("/proc/self/smaps_rollup", "AnonHugePages")


def _read_rates(model) -> dict:
    """GB/s streaming this process's own weight blocks (wherever its pages landed), and a fresh
    buffer of as many bytes, through the kernels' `stream_read`: if slow processes read their
    weights slower than fresh memory, or all memory slower, the cause is where memory sits, not
    the products."""
    import torch

    from cadenza.bench.common.device import best_seconds
    from cadenza.kernels.cpu import loader

    kernels = loader.configure("auto")
    blocks = [b for name, b in model.named_buffers() if name.rsplit(".", 1)[-1].startswith("blocks")]
    nbytes = sum(b.nbytes for b in blocks)
    if kernels is None or not nbytes:
        return {}
    fresh = torch.ones(nbytes // 4, dtype=torch.float32)
    weights = best_seconds(lambda: [kernels.stream_read(b) for b in blocks])
    other = best_seconds(lambda: kernels.stream_read(fresh))
    return {"weights_read_gbps": round(nbytes / weights / 1e9, 2), "fresh_read_gbps": round(nbytes / other / 1e9, 2)}


def child_measure(model: str, plan: SpreadPlan) -> dict:
    """In this (fresh) process: load `model`, decode `plan.repeats` times; rates and the process's look."""
    import torch  # noqa: F401 (imported before the first reading: its own memory is not the model's)

    from cadenza.bench.common.engines import CadenzaEngine
    from cadenza.bench.offline.latency import CadenzaProbe
    from cadenza.threads import compute_thread

    overrides = {"model.quantization": plan.quantization} if plan.quantization else {}
    imported = _resident_kib()
    engine = CadenzaEngine(model, dtype=plan.dtype, num_threads=plan.num_threads, overrides=overrides,
                           config_path=plan.config)
    loaded = _resident_kib()  # before any step: the KV cache's pages are not resident until written
    probe = CadenzaProbe(engine, plan.temperature)
    probe.decode_tokens_per_second(1, plan.prompt_len, 8, seed=0)  # warm: first-step allocations, page-ins
    before = _thread_ticks()
    rates = [compute_thread.run_sync(probe.decode_tokens_per_second, 1, plan.prompt_len, plan.decode_tokens, seed)
             for seed in range(1, plan.repeats + 1)]
    after = _thread_ticks()
    reads = compute_thread.run_sync(_read_rates, engine.runtime.loaded.model)
    busy = sorted(((after[t][0] - before[t][0], after[t][1]) for t in after if t in before), reverse=True)
    load_mib = None if imported is None or loaded is None else round((loaded - imported) / 1024, 1)
    return {"rates": rates, "best": max(rates), "load_seconds": round(engine.load_seconds, 2),
            "load_resident_mib": load_mib, "file_mib": round(Path(model).stat().st_size / 2**20, 1),
            "anon_huge_kib": _anon_huge_kib(), **reads,
            "busiest_threads": [{"ticks": t, "last_cpu": cpu} for t, cpu in busy[: max(2, plan.num_threads or 2)]]}


def _run_child(model: str, plan: SpreadPlan) -> dict:
    command = [sys.executable, "-m", "cadenza.bench.offline.spread", "--child", model,
               "--prompt-len", str(plan.prompt_len), "--decode-tokens", str(plan.decode_tokens),
               "--repeats", str(plan.repeats), "--dtype", plan.dtype, "--temperature", str(plan.temperature)]
    for flag, value in (("--num-threads", plan.num_threads), ("--config", plan.config), ("--quantization", plan.quantization)):
        if value:
            command += [flag, str(value)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the cadenza process exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def run_spread(model: str, plan: SpreadPlan, policy: QuietPolicy, llamacpp_path: Path | None,
               log=print) -> list[EngineSpread]:
    """`plan.processes` rounds; in each, a fresh cadenza process, then (when given) a fresh
    llama-bench on `llamacpp_path` at the same threads and tokens, best of `plan.repeats` each."""
    ours = EngineSpread("cadenza")
    spreads = [ours]
    peer = None
    if llamacpp_path is not None:
        from cadenza.bench.peers.llamacpp import file_precision
        from cadenza.bench.peers.llamacpp_binaries import LlamaBinaryProbe

        threads = plan.num_threads or os.cpu_count() or 1
        peer = LlamaBinaryProbe(llamacpp_path, file_precision(llamacpp_path), threads)
        spreads.append(EngineSpread(peer.name))
    for round_ in range(plan.processes):
        result, quiet = run_quietly(lambda: _run_child(model, plan), policy, on_compute_thread=False)
        ours.rates.append(result["best"])
        ours.details.append(result)
        ours.quiet.append(quiet)
        threads = ", ".join(f"{t['ticks']} ticks on CPU {t['last_cpu']}" for t in result["busiest_threads"])
        reads = (f"; weights read at {result['weights_read_gbps']} GB/s, fresh memory {result['fresh_read_gbps']}"
                 if "weights_read_gbps" in result else "")
        log(f"  round {round_ + 1}: cadenza {result['best']:.1f} tok/s (repeats {', '.join(f'{r:.1f}' for r in result['rates'])}; "
            f"load added {result['load_resident_mib']} MiB resident for a {result['file_mib']} MiB file, "
            f"{(result['anon_huge_kib'] or 0) >> 10} MiB in huge pages; threads {threads}{reads}) ({quiet.describe()})")
        if peer is not None:
            rate, quiet = run_quietly(lambda: peer.best_decode_rate(plan.prompt_len, plan.decode_tokens, plan.repeats),
                                      policy, on_compute_thread=False)
            spreads[1].rates.append(rate)
            spreads[1].quiet.append(quiet)
            log(f"  round {round_ + 1}: {peer.name} {rate:.1f} tok/s ({quiet.describe()})")
    return spreads


def render_spread(spreads: list[EngineSpread]) -> str:
    from cadenza.bench.common.report import table

    rows = []
    for spread in spreads:
        s = spread.summary()
        if s["processes"]:
            rows.append([s["engine"], s["processes"], s["disturbed"], s["min"], s["median"], s["max"],
                         f"{100 * s['slowest_over_fastest']:.1f}%"])
    lines = [table(["engine", "quiet processes", "disturbed", "min tok/s", "median", "max", "slowest / fastest"], rows)]
    if len(spreads) == 2 and spreads[1].rates:
        ours, peer = spreads[0].summary(), spreads[1].summary()
        lines.append(f"  cadenza / {spreads[1].engine}: median {ours['median'] / peer['median']:.2f}x, "
                     f"slowest {ours['min'] / peer['min']:.2f}x, fastest {ours['max'] / peer['max']:.2f}x")
    return "\n".join(lines)


def _child_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m cadenza.bench.offline.spread --child")
    parser.add_argument("--child", required=True, metavar="MODEL")
    parser.add_argument("--prompt-len", type=int, default=SpreadPlan.prompt_len)
    parser.add_argument("--decode-tokens", type=int, default=SpreadPlan.decode_tokens)
    parser.add_argument("--repeats", type=int, default=SpreadPlan.repeats)
    parser.add_argument("--num-threads", type=int)
    parser.add_argument("--dtype", default=SpreadPlan.dtype)
    parser.add_argument("--temperature", type=float, default=SpreadPlan.temperature)
    parser.add_argument("--config")
    parser.add_argument("--quantization")
    args = parser.parse_args(argv)
    from cadenza.config.logging_setup import configure_logging

    configure_logging("warning", "console")
    plan = SpreadPlan(1, args.prompt_len, args.decode_tokens, args.repeats, args.num_threads, args.dtype, args.temperature,
                      args.config, args.quantization)
    print(json.dumps(child_measure(args.child, plan)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[1:]))
