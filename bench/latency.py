"""`cadenza bench latency`: batch-1 decode, prefill and batch-N decode, next to this machine's ceilings.

Each engine answers two questions through a probe: how long does a prompt of L tokens take to
prefill (to its first sampled token), and how many tokens per second does a batch of B decode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from cadenza.bench.ceilings import Ceilings, ModelCost
from cadenza.bench.quiet import QuietPolicy, QuietReport, run_quietly
from cadenza.bench.workload import random_prompt


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
        from cadenza.bench.model_step import time_model_steps

        return time_model_steps(self.runtime, batch=1, prompt_len=length, decode_steps=1,
                                temperature=self.temperature, seed=seed).prefill_seconds

    def decode_tokens_per_second(self, batch: int, prompt_len: int, num_tokens: int, seed: int) -> float:
        from cadenza.bench.model_step import time_model_steps

        timing = time_model_steps(self.runtime, batch=batch, prompt_len=prompt_len, decode_steps=num_tokens,
                                  temperature=self.temperature, seed=seed)
        return batch / timing.decode_step_seconds


class HFProbe:
    """transformers `generate`: prefill is a 1-token generate; decode is the difference n+1 minus 1."""

    name = "hf generate"

    def __init__(self, model, temperature: float) -> None:
        from cadenza.bench.peers import _pad_id, _sampling_kwargs

        self.model, self.pad = model, _pad_id(model)
        self.kwargs = _sampling_kwargs(temperature)
        self.vocab = model.config.vocab_size

    def _seconds(self, prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts)
        started = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, pad_token_id=self.pad, **self.kwargs)
        return time.perf_counter() - started

    def prefill_seconds(self, length: int, seed: int) -> float:
        return self._seconds([random_prompt(length, seed=seed, vocab_size=self.vocab)], 1)

    def decode_tokens_per_second(self, batch: int, prompt_len: int, num_tokens: int, seed: int) -> float:
        prompts = [random_prompt(prompt_len, seed=seed * 1000 + i, vocab_size=self.vocab) for i in range(batch)]
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


def run_latency(probes: list[LatencyProbe], plan: LatencyPlan, cost: ModelCost, ceilings: Ceilings,
                dtype: torch.dtype, policy: QuietPolicy, log: Callable[[str], None] = print) -> list[LatencyRow]:
    rows: list[LatencyRow] = []
    context = plan.decode_prompt_len + plan.decode_tokens // 2

    def best(fn: Callable[[int], float | None], higher_is_better: bool) -> Callable[[], float | None]:
        def run() -> float | None:
            values = [fn(seed) for seed in range(1, plan.repeats + 1)]
            if any(v is None for v in values):
                return None
            return max(values) if higher_is_better else min(values)
        return run

    for probe in probes:
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
    return rows


def _progress(row: LatencyRow) -> str:
    rate = "n/a" if row.tokens_per_second is None else f"{row.tokens_per_second:.1f} tok/s"
    return f"  {row.engine}: {row.measure}: {rate} ({row.quiet.describe() if row.quiet else ''})"
