"""`cadenza bench latency`: batch-1 decode, prefill and batch-N decode, next to this machine's ceilings.

Each engine answers two questions through a probe: how long does a prompt of L tokens take to
prefill (to its first sampled token), and how many tokens per second does a batch of B decode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from cadenza.bench.common.quiet import QuietPolicy, QuietReport, run_quietly
from cadenza.bench.common.workload import random_prompt
from cadenza.bench.offline.ceilings import Ceilings, ModelCost


class LatencyProbe(Protocol):
    name: str

    def prefill_seconds(self, length: int, seed: int) -> float: ...

    def decode_tokens_per_second(self, batch: int, prompt_len: int, num_tokens: int, seed: int) -> float | None: ...


@dataclass(slots=True)
class LatencyRow:
    measure: str
    engine: str
    tokens_per_second: float | None
    ceiling_tokens_per_second: float
    model_flops: float | None  # model FLOP/s achieved (large batches)
    quiet: QuietReport | None

    def as_dict(self) -> dict:
        return {
            "measure": self.measure,
            "engine": self.engine,
            "tokens_per_s": None if self.tokens_per_second is None else round(self.tokens_per_second, 2),
            "ceiling_tokens_per_s": round(self.ceiling_tokens_per_second, 2),
            "achieved_over_ceiling": None if self.tokens_per_second is None
            else round(self.tokens_per_second / self.ceiling_tokens_per_second, 4),
            "model_GFLOPps": None if self.model_flops is None else round(self.model_flops / 1e9, 2),
            "quiet": self.quiet.as_dict() if self.quiet else None,
        }


class CadenzaProbe:
    """Through the whole engine: actors, channels, detokenizer, streams."""

    name = "cadenza"

    def __init__(self, engine, temperature: float) -> None:
        self.engine, self.temperature = engine, temperature
        self.vocab = engine.arch.vocab_size

    def prefill_seconds(self, length: int, seed: int) -> float:
        from cadenza.sampling_params import SamplingParams

        prompt = random_prompt(length, seed=seed, vocab_size=self.vocab)
        _, done = self.engine.generate([prompt], [SamplingParams(temperature=self.temperature, max_tokens=1, ignore_eos=True)])
        return done[0].ttft_seconds

    def decode_tokens_per_second(self, batch: int, prompt_len: int, num_tokens: int, seed: int) -> float:
        """Tokens after each request's first over the span when all of them are decoding."""
        from cadenza.sampling_params import SamplingParams

        prompts = [random_prompt(prompt_len, seed=seed * 1000 + i, vocab_size=self.vocab) for i in range(batch)]
        params = [SamplingParams(temperature=self.temperature, max_tokens=num_tokens + 1, ignore_eos=True)] * batch
        _, done = self.engine.generate(prompts, params)
        span = max(f.e2e_seconds for f in done) - max(f.ttft_seconds for f in done)
        return sum(f.num_output_tokens - 1 for f in done) / span


class CadenzaModelProbe:
    """`ModelRunner.execute` alone: the model and the sampling pipeline, no engine around them."""

    name = "cadenza model step"

    def __init__(self, engine, temperature: float) -> None:
        self.runtime, self.temperature = engine.runtime, temperature

    def prefill_seconds(self, length: int, seed: int) -> float:
        from cadenza.bench.offline.model_step import time_model_steps

        return time_model_steps(self.runtime, batch=1, prompt_len=length, decode_steps=1,
                                temperature=self.temperature, seed=seed).prefill_seconds

    def decode_tokens_per_second(self, batch: int, prompt_len: int, num_tokens: int, seed: int) -> float:
        from cadenza.bench.offline.model_step import time_model_steps

        timing = time_model_steps(self.runtime, batch=batch, prompt_len=prompt_len, decode_steps=num_tokens,
                                  temperature=self.temperature, seed=seed)
        return batch / timing.decode_step_seconds


class HFProbe:
    """transformers `generate`: prefill is a 1-token generate; decode is the difference n+1 minus 1.

    `compiled`: with transformers' static cache and compiled decode step (`static_compile_kwargs`),
    the cache as long as each measure needs; each decode shape runs once untimed first (its compile,
    on a GPU its CUDA graphs recorded). The device is synchronized before each clock reading.
    """

    def __init__(self, model, temperature: float, *, compiled: bool = False) -> None:
        from cadenza.bench.peers.hf import _pad_id, _sampling_kwargs, static_compile_kwargs

        self.model, self.pad, self.compiled = model, _pad_id(model), compiled
        self.name = "hf static+compile" if compiled else "hf generate"
        self.kwargs = _sampling_kwargs(temperature) | (static_compile_kwargs(model.device) if compiled else {})
        self.vocab = model.config.vocab_size

    def _seconds(self, prompts: list[list[int]], new_tokens: int) -> float:
        from cadenza.bench.common.device import synchronize
        from cadenza.bench.peers.hf import no_grad, size_static_cache

        ids = torch.tensor(prompts, device=self.model.device)
        if self.compiled:
            size_static_cache(self.model, ids.shape[1] + new_tokens)
        synchronize(self.model.device)
        started = time.perf_counter()
        with no_grad(self.compiled):
            self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, pad_token_id=self.pad, **self.kwargs)
        synchronize(self.model.device)
        return time.perf_counter() - started

    def prefill_seconds(self, length: int, seed: int) -> float:
        return self._seconds([random_prompt(length, seed=seed, vocab_size=self.vocab)], 1)  # prefill is eager

    def decode_tokens_per_second(self, batch: int, prompt_len: int, num_tokens: int, seed: int) -> float:
        prompts = [random_prompt(prompt_len, seed=seed * 1000 + i, vocab_size=self.vocab) for i in range(batch)]
        if self.compiled:
            self._seconds(prompts, num_tokens + 1)  # compiles (records) this batch's and cache length's step
        whole = self._seconds(prompts, num_tokens + 1)
        first = self._seconds(prompts, 1)
        return batch * num_tokens / max(whole - first, 1e-9)


@dataclass(frozen=True, slots=True)
class LatencyPlan:
    prefill_lens: tuple[int, ...] = (128, 512, 1024)
    decode_prompt_len: int = 32
    decode_tokens: int = 64
    batch: int = 32
    repeats: int = 3  # best of


def add_peer_probes(args, engine, load_format: str, hf_variants: tuple[str, ...], probes: list
                    ) -> tuple[dict[str, str], dict | None]:
    """Append the peers' probes for `args.compare`, on cadenza's device; returns why any was
    skipped, and the same-weights check (`greedy_agreement`) when transformers runs."""
    skipped: dict[str, str] = {}
    weights_check = None
    if "hf" in args.compare:
        from cadenza.bench.peers.hf import describe_agreement, load_hf_model, same_weights_check
        from cadenza.threads import compute_thread

        try:
            model = compute_thread.run_sync(load_hf_model, engine.source, args.dtype, device=engine.device,
                                            load_format=load_format, seed=args.seed)
        except Exception as exc:
            skipped["hf"] = f"transformers could not load {engine.source}: {exc}"
        else:
            weights_check = same_weights_check(engine, model)
            print(describe_agreement(weights_check))
            for variant in hf_variants:
                if variant != "continuous":  # a scheduler of its own: a throughput peer
                    probes.append(HFProbe(model, args.temperature, compiled=variant == "compiled"))
    if "llamacpp" in args.compare:
        import os

        from cadenza.bench.offline.throughput import default_gguf_cache
        from cadenza.bench.peers.llamacpp import peer_files, why_llamacpp_cannot_run
        from cadenza.bench.peers.llamacpp_binaries import LlamaBinaryProbe

        source = Path(engine.source)
        why = why_llamacpp_cannot_run(source) if engine.device.type == "cpu" else "llama.cpp runs on the CPU here"
        if why is not None:
            skipped["llama.cpp"] = why
        else:
            threads = args.num_threads or min(os.cpu_count() or 1, torch.get_num_threads())
            for kind, path in peer_files(source, args.llamacpp_precisions, args.gguf_cache or default_gguf_cache()):
                probes.append(LlamaBinaryProbe(path, kind, threads))
    return skipped, weights_check


def run_latency(probes: list[LatencyProbe], plan: LatencyPlan, cost: ModelCost, ceilings: Ceilings,
                dtype: torch.dtype, policy: QuietPolicy, log: Callable[[str], None] = print,
                failed: dict[str, str] | None = None) -> list[LatencyRow]:
    """Every probe's measures, probe by probe. A peer that raises is recorded in `failed` (when
    given) and the others still run; cadenza's own probe raises."""
    rows: list[LatencyRow] = []
    for probe in probes:
        try:
            _measure(probe, plan, cost, ceilings, dtype, policy, log, rows)
        except Exception as exc:
            if failed is None or probe.name == "cadenza":
                raise
            failed[probe.name] = f"failed: {exc!r}"
            log(f"  {probe.name}: failed: {exc!r}")
    return rows


def _measure(probe: LatencyProbe, plan: LatencyPlan, cost: ModelCost, ceilings: Ceilings, dtype: torch.dtype,
             policy: QuietPolicy, log: Callable[[str], None], rows: list[LatencyRow]) -> None:
    context = plan.decode_prompt_len + plan.decode_tokens // 2

    def best(fn: Callable[[int], float | None], higher_is_better: bool) -> Callable[[], float | None]:
        def run() -> float | None:
            values = [fn(seed) for seed in range(1, plan.repeats + 1)]
            if any(v is None for v in values):
                return None
            return max(values) if higher_is_better else min(values)
        return run

    decode_1 = f"decode, batch 1, ctx {plan.decode_prompt_len}+{plan.decode_tokens}"
    rate, quiet = run_quietly(best(lambda s: probe.decode_tokens_per_second(1, plan.decode_prompt_len, plan.decode_tokens, s), True), policy)
    rows.append(LatencyRow(decode_1, probe.name, rate, 1 / cost.decode_step_seconds(ceilings, dtype, 1, context), None, quiet))
    log(_progress(rows[-1]))
    for length in plan.prefill_lens:
        seconds, quiet = run_quietly(best(lambda s: probe.prefill_seconds(length, 100 + s), False), policy)
        rows.append(LatencyRow(f"prefill {length}", probe.name, length / seconds,
                               length / cost.prefill_seconds(ceilings, dtype, length), None, quiet))
        log(_progress(rows[-1]))
    measure = f"decode, batch {plan.batch}, ctx {plan.decode_prompt_len}+{plan.decode_tokens}"
    rate, quiet = run_quietly(best(lambda s: probe.decode_tokens_per_second(plan.batch, plan.decode_prompt_len, plan.decode_tokens, s), True), policy)
    flops = None if rate is None else rate * cost.decode_flops(context)
    ceiling = plan.batch / cost.decode_step_seconds(ceilings, dtype, plan.batch, context)
    rows.append(LatencyRow(measure, probe.name, rate, ceiling, flops, quiet))
    log(_progress(rows[-1]))


def _progress(row: LatencyRow) -> str:
    rate = "n/a" if row.tokens_per_second is None else f"{row.tokens_per_second:.1f} tok/s"
    return f"  {row.engine}: {row.measure}: {rate} ({row.quiet.describe() if row.quiet else ''})"


def describe_ceilings(ceilings: Ceilings, cost: ModelCost, dtype: torch.dtype, quiet: QuietReport) -> str:
    """The measured ceilings, the model's bytes and FLOPs, and the step times they predict."""
    from cadenza.bench.common.report import flops

    copied = " (bytes read + written)" if ceilings.memory_measure == "device copy" else ""
    read_ms = 1e3 * cost.weight_bytes / ceilings.memory_bandwidth
    rate = ceilings.matmul_fp32 if dtype == torch.float32 else ceilings.matmul_bf16
    prefill_ms = 1e3 * cost.prefill_flops(512) / ceilings.matmul(dtype) / 512
    return "\n".join([
        f"ceilings: {ceilings.memory_measure} {ceilings.memory_bandwidth / 1e9:.2f} GB/s{copied}, matmul bf16 "
        f"{flops(ceilings.matmul_bf16)}, fp32 {flops(ceilings.matmul_fp32)} "
        f"(F.linear {'x'.join(map(str, ceilings.matmul_shape))}) ({quiet.describe()})",
        f"model: {cost.weight_bytes / 1e6:.0f} MB of weights read per decode step of one token, "
        f"{cost.decode_flops(0) / 1e6:.0f} MFLOP per token"
        + (f" (a mixture: {cost.top_k} of {cost.num_experts} experts a token, {cost.expert_bytes / 1e6:.0f} MB of "
           f"experts in all; a step of 8 tokens reads {cost.step_weight_bytes(8) / 1e6:.0f} MB)" if cost.expert_bytes else ""),
        f"predicted batch-1 decode step: weights / bandwidth {read_ms:.2f} ms, FLOPs / "
        f"{str(dtype).removeprefix('torch.')} matmul rate {1e3 * cost.decode_flops(0) / rate:.2f} ms; prefill: "
        f"{prefill_ms:.4f} ms per token at 512 (best matmul rate)",
    ])


def render_latency(rows: list[LatencyRow], ceilings: Ceilings, skipped: dict[str, str]) -> str:
    """The table of every measure, cadenza's decode over its ceiling, and what did not run."""
    from cadenza.bench.common.report import percent, table

    lines = [table(
        ["measure", "engine", "tok/s", "ceiling tok/s", "achieved", "% bf16 mm", "% fp32 mm", "machine"],
        [[r.measure, r.engine, r.tokens_per_second, r.ceiling_tokens_per_second,
          percent(r.tokens_per_second, r.ceiling_tokens_per_second),
          percent(r.model_flops, ceilings.matmul_bf16), percent(r.model_flops, ceilings.matmul_fp32),
          r.quiet.describe() if r.quiet else "-"] for r in rows],
    )]
    ours = [r for r in rows if r.engine == "cadenza" and r.measure.startswith("decode")]
    lines.append("  cadenza's decode over its ceiling: " + ", ".join(
        f"{r.measure.split(', ')[1]} {percent(r.tokens_per_second, r.ceiling_tokens_per_second)}" for r in ours))
    lines += [f"  {name}: {why}" if why.startswith("failed") else f"  {name}: skipped ({why})"
              for name, why in skipped.items()]
    lines.append(f"  ceiling: decode = weight (+KV) bytes / {ceilings.memory_measure} bandwidth, or FLOPs / matmul rate "
                 "if slower; prefill = FLOPs / matmul rate; for bf16 weights the faster of the bf16 and fp32 (exact "
                 "upcast) rates")
    lines.append("  % bf16 mm, % fp32 mm: the large-batch decode's model FLOP/s over each matmul rate")
    return "\n".join(lines)
