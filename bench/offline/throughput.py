"""`cadenza bench throughput`: one seeded offline workload through cadenza and its peers, same process."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from cadenza.bench.common.engines import EngineRun
from cadenza.bench.common.quiet import QuietPolicy, run_quietly
from cadenza.bench.common.report import table
from cadenza.bench.common.workload import Workload


@dataclass(slots=True)
class ThroughputResult:
    workload: Workload
    runs: list[EngineRun] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # peer -> why it did not run
    load_seconds: dict[str, float] = field(default_factory=dict)
    weights_check: dict | None = None  # cadenza's and transformers' greedy tokens (`greedy_agreement`)

    @property
    def cadenza(self) -> EngineRun | None:
        return next((r for r in self.runs if r.engine == "cadenza"), None)

    def render(self) -> str:
        base = self.cadenza
        rows = []
        for run in self.runs:
            ratio = None
            if base is not None and run is not base:
                ratio = f"{base.output_tokens_per_second / run.output_tokens_per_second:.2f}x"
            rows.append([
                run.engine, run.seconds, run.output_tokens_per_second, run.total_tokens_per_second,
                ratio or "-", run.quiet.describe() if run.quiet else "-",
            ])
        lines = [table(["engine", "seconds", "output tok/s", "total tok/s", "cadenza/peer", "machine"], rows)]
        lines += [f"  {r.engine}: {r.note}" for r in self.runs if r.note]
        if base is not None and "kv_unused_at_peak" in base.extra:
            lines.append(f"  cadenza KV cache: at the peak of allocation ({base.extra['kv_slots_allocated_peak']} token slots), "
                         f"allocated-but-unused slots were {100 * base.extra['kv_unused_at_peak']:.1f}% of used ones; "
                         f"{base.extra['preemptions']} preemptions")
        lines += [f"  {name}: skipped ({why})" for name, why in self.skipped.items()]
        if self.weights_check is not None:
            from cadenza.bench.peers.hf import describe_agreement

            lines.append(f"  {describe_agreement(self.weights_check)}")
        if self.load_seconds:
            lines.append("  load: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.load_seconds.items()))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        base = self.cadenza
        runs = []
        for run in self.runs:
            entry = run.as_dict()
            if base is not None and run is not base:
                entry["cadenza_over_peer_output"] = round(base.output_tokens_per_second / run.output_tokens_per_second, 3)
            runs.append(entry)
        return {
            "workload": self.workload.describe(),
            "runs": runs,
            "skipped": self.skipped,
            "load_seconds": {k: round(v, 2) for k, v in self.load_seconds.items()},
            "weights_check": self.weights_check,
        }


def run_throughput(
    cadenza,
    workload: Workload,
    *,
    compare: list[str],
    dtype: str,
    policy: QuietPolicy,
    hf_batch_size: int = 32,
    hf_variants: Sequence[str] = ("generate", "continuous"),
    load_format: str = "auto",
    num_threads: int | None = None,
    gguf_cache: Path | None = None,
    seed: int = 0,
    llamacpp_parallel: int = 32,
    llamacpp_precisions: Sequence[str] = ("file", "Q8_0"),
    log: Callable[[str], None] = print,
) -> ThroughputResult:
    """`cadenza` is a built `CadenzaEngine`; peers are loaded here, one after another, on its device."""
    result = ThroughputResult(workload, load_seconds={"cadenza": cadenza.load_seconds})

    def timed(engine) -> None:
        log(f"running {getattr(engine, 'name', engine)} ...")
        run, quiet = run_quietly(lambda: engine.run(workload), policy)
        run.quiet = quiet
        result.runs.append(run)
        log(f"  {run.engine}: {run.output_tokens_per_second:.1f} output tok/s in {run.seconds:.1f}s ({quiet.describe()})")

    timed(cadenza)
    if "hf" in compare:
        _run_hf(cadenza, dtype, hf_batch_size, hf_variants, load_format, seed, result, timed, log)
    if "llamacpp" in compare:
        _run_llamacpp(cadenza, num_threads, gguf_cache, seed, llamacpp_parallel, llamacpp_precisions, workload,
                      result, timed, log)
    return result


def _run_hf(cadenza, dtype: str, batch_size: int, variants: Sequence[str], load_format: str, seed: int,
            result: ThroughputResult, timed, log) -> None:
    from cadenza.bench.peers.hf import (
        HFContinuousEngine,
        HFStaticEngine,
        describe_agreement,
        has_continuous_batching,
        load_hf_model,
        same_weights_check,
    )
    from cadenza.threads import compute_thread

    log("loading the transformers model ...")
    started = time.perf_counter()
    try:
        model = compute_thread.run_sync(load_hf_model, cadenza.source, dtype, device=cadenza.device,
                                        load_format=load_format, seed=seed)
    except Exception as exc:  # an architecture or GGUF quantization transformers cannot load
        result.skipped["hf"] = f"transformers could not load {cadenza.source}: {exc}"
        return
    result.load_seconds["hf"] = time.perf_counter() - started
    result.weights_check = same_weights_check(cadenza, model)
    log(f"  {describe_agreement(result.weights_check)}")
    if "generate" in variants:
        timed(HFStaticEngine(model, batch_size))
    if "compiled" in variants:
        try:
            timed(HFStaticEngine(model, batch_size, compiled=True))
        except Exception as exc:  # a torch.compile failure is transformers' result, not the bench's end
            result.skipped["hf-compiled"] = f"failed: {exc!r}"
    if "continuous" not in variants:
        return
    if has_continuous_batching(model):
        try:
            timed(HFContinuousEngine(model))
        except Exception as exc:
            result.skipped["hf-continuous"] = f"failed: {exc}"
    else:
        result.skipped["hf-continuous"] = "this transformers has no generate_batch"


def _run_llamacpp(cadenza, num_threads, gguf_cache, seed, parallel, precisions, workload: Workload,
                  result: ThroughputResult, timed, log) -> None:
    import os

    import torch

    from cadenza.bench.peers.llamacpp import peer_files, why_llamacpp_cannot_run
    from cadenza.bench.peers.llamacpp_server import LlamaServerEngine

    source = Path(cadenza.source)
    why = why_llamacpp_cannot_run(source) if cadenza.device.type == "cpu" else "llama.cpp runs on the CPU here"
    if why is not None:
        result.skipped["llama.cpp"] = why
        return
    log("preparing the GGUF files for llama.cpp ...")
    threads = num_threads or min(os.cpu_count() or 1, torch.get_num_threads())
    max_len = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests) + 16
    for kind, path in peer_files(source, list(precisions), gguf_cache or default_gguf_cache()):
        timed(LlamaServerEngine(path, kind, num_threads=threads, parallel=parallel, max_len=max_len, seed=seed))


def default_gguf_cache() -> Path:
    return Path.home() / ".cache" / "cadenza" / "bench"
