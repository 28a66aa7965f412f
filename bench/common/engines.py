"""cadenza behind the bench's one call, `run(workload) -> EngineRun`, plus what every engine reports.

The engine is built once (`build_runtime`) and each run starts a fresh `AsyncEngine` on it, warms it
up with a short request, then times the whole workload submitted at once, as `LLM.generate` does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from cadenza.bench.common.quiet import QuietReport
from cadenza.bench.common.workload import Workload


@dataclass(slots=True)
class EngineRun:
    """One engine's timed pass over a workload.

    `num_output_tokens` counts the tokens the workload asked for; an engine that computes more
    (a static batch runs every row to its longest request) says so in `num_computed_tokens`.
    """

    engine: str
    seconds: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    quiet: QuietReport | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens_per_second(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def total_tokens_per_second(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.seconds

    def as_dict(self) -> dict:
        return {
            "engine": self.engine,
            "seconds": round(self.seconds, 3),
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "computed_output_tokens": self.num_computed_tokens,
            "output_tokens_per_s": round(self.output_tokens_per_second, 2),
            "total_tokens_per_s": round(self.total_tokens_per_second, 2),
            "quiet": self.quiet.as_dict() if self.quiet else None,
            "note": self.note,
            **self.extra,
        }


@dataclass(frozen=True, slots=True)
class Finished:
    """A finished request as the bench sees it: counts and the engine's own timings."""

    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    ttft_seconds: float | None
    tpot_seconds: float | None
    e2e_seconds: float
    error: str | None = None
    token_ids: tuple[int, ...] = ()


class CadenzaEngine:
    name = "cadenza"

    def __init__(self, model: str | Path | None, *, dtype: str = "bfloat16", num_threads: int | None = None,
                 overrides: dict[str, Any] | None = None, config_path: str | None = None) -> None:
        from cadenza.config import load_config
        from cadenza.runtime.build import build_runtime

        started = time.perf_counter()
        dotted = {"model.path": None if model is None else str(model), "model.dtype": dtype,
                  "model.num_threads": num_threads, **(overrides or {})}
        self.config = load_config(config_path, overrides={k: v for k, v in dotted.items() if v is not None})
        self.runtime = build_runtime(self.config)
        self.load_seconds = time.perf_counter() - started

    @property
    def arch(self):
        return self.runtime.loaded.arch

    @property
    def dtype(self):
        return self.runtime.loaded.dtype

    @property
    def device(self):
        return self.runtime.loaded.device

    @property
    def kv_dtype(self):
        """The KV cache's (and activations') dtype: float32 where bf16 weights run dual precision."""
        return getattr(self.runtime.loaded, "compute_dtype", None) or self.dtype

    @property
    def source(self) -> str:
        return self.runtime.loaded.source

    def run(self, workload: Workload) -> EngineRun:
        from cadenza.sampling_params import SamplingParams

        prompts = [r.prompt_token_ids for r in workload.requests]
        params = [SamplingParams(temperature=workload.temperature, max_tokens=r.max_tokens, ignore_eos=True)
                  for r in workload.requests]
        seconds, finished = self.generate(prompts, params)
        metrics = self.last_metrics
        return EngineRun(
            engine=self.name,
            seconds=seconds,
            num_prompt_tokens=sum(f.num_prompt_tokens for f in finished),
            num_output_tokens=sum(f.num_output_tokens for f in finished),
            num_computed_tokens=sum(f.num_output_tokens for f in finished),
            note=_failures(finished),
            extra={
                "kv_slots_allocated_peak": metrics.kv_slots_allocated_peak,
                "kv_unused_at_peak": round(metrics.kv_unused_at_peak, 4),
                "preemptions": metrics.num_preemptions,
            },
        )

    def generate(self, prompts: Sequence[list[int]], params: Sequence[Any], *, warmup: bool = True
                 ) -> tuple[float, list[Finished]]:
        """Seconds from submitting every request until the last finished, and each request's record."""
        import anyio

        return anyio.run(self._generate, list(prompts), list(params), warmup)

    async def _generate(self, prompts, params, warmup: bool) -> tuple[float, list[Finished]]:
        import anyio

        from cadenza.engine.async_engine import AsyncEngine
        from cadenza.sampling_params import SamplingParams

        async with AsyncEngine.serve(self.runtime) as engine:
            if warmup:
                await _collect_all(engine, [list(range(100, 116))], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)], anyio)
                engine.metrics.kv_slots_allocated_peak = engine.metrics.kv_slots_filled_at_peak = 0
            started = time.perf_counter()
            finished = await _collect_all(engine, prompts, params, anyio)
            self.last_metrics = engine.metrics  # the run's counters, KV peak included
            return time.perf_counter() - started, finished


async def _collect_all(engine, prompts, params, anyio) -> list[Finished]:
    results: list[Finished | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        count, last, tokens = 0, None, []
        async for out in engine.generate(prompts[i], params[i]):
            count, last = out.num_output_tokens, out
            tokens.extend(out.token_ids)
        timings = last.timings
        results[i] = Finished(
            num_prompt_tokens=last.num_prompt_tokens,
            num_output_tokens=count,
            finish_reason=last.finish_reason,
            ttft_seconds=timings.ttft_seconds if timings else None,
            tpot_seconds=timings.tpot_seconds if timings else None,
            e2e_seconds=timings.e2e_seconds if timings else 0.0,
            error=last.error,
            token_ids=tuple(tokens),
        )

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results  # type: ignore[return-value]


def _failures(finished: list[Finished]) -> str:
    errors = [f.error or f.finish_reason for f in finished if f.finish_reason not in ("length", "stop")]
    return f"{len(errors)} requests failed: {errors[0]}" if errors else ""
