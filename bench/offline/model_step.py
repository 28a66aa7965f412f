"""The model step alone: `ModelRunner.execute` driven directly, with no actors, channels or streams.

Next to the engine's own numbers this splits a step's time into the model (matmuls, attention,
sampling) and the engine around it (scheduling, messaging, detokenizing). It writes KV blocks the
cache manager never handed out, so run it only while no engine serves this runtime's cache.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, ContextManager

from cadenza.bench.common.workload import random_prompt


@dataclass(frozen=True, slots=True)
class StepTiming:
    prefill_seconds: float  # the whole batch's prompts, one step each
    decode_step_seconds: float  # best mean over the decode steps


def _chunk(rid: str, tokens: list[int], start: int, table: list[int], params, prompt: list[int]):
    from cadenza.step import ScheduledChunk

    # The runner keeps each request's sampled tokens itself, as the engine's steps rely on.
    return ScheduledChunk(rid, tokens, start, table, True, params, prompt)


def time_model_steps(runtime, *, batch: int, prompt_len: int, decode_steps: int, temperature: float,
                     seed: int = 0, around_decode: Callable[[], ContextManager] = contextlib.nullcontext) -> StepTiming:
    """Prefill `batch` random prompts (one step per prompt), then time `decode_steps` decode steps.

    `around_decode` wraps the decode steps alone (a profiler, say).
    """
    from cadenza.sampling_params import SamplingParams

    runner, block_size = runtime.runner, runtime.block_size
    blocks_per_seq = -(-(prompt_len + decode_steps + 1) // block_size)
    if batch * blocks_per_seq > runtime.num_blocks:
        raise ValueError(f"model-only timing needs {batch * blocks_per_seq} KV blocks, the cache has {runtime.num_blocks}")
    params = SamplingParams(temperature=temperature, max_tokens=decode_steps + 1, ignore_eos=True)
    vocab = runtime.loaded.arch.vocab_size
    prompts = [random_prompt(prompt_len, seed=seed * 1000 + i, vocab_size=vocab) for i in range(batch)]
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    outputs: list[list[int]] = [[] for _ in range(batch)]
    started = time.perf_counter()
    for i in range(batch):
        result = runner.execute([_chunk(f"m{i}", prompts[i], 0, tables[i], params, prompts[i])])
        outputs[i].append(int(result.sampled.token_ids[0]))
    prefill = time.perf_counter() - started
    with around_decode():
        started = time.perf_counter()
        for step in range(decode_steps):
            chunks = [
                _chunk(f"m{i}", [outputs[i][-1]], prompt_len + step, tables[i], params, prompts[i])
                for i in range(batch)
            ]
            result = runner.execute(chunks)
            for i, token in enumerate(result.sampled.token_ids.tolist()):
                outputs[i].append(token)
        decode = (time.perf_counter() - started) / decode_steps
    if hasattr(runner, "finish_requests"):  # sampling plugins drop their per-request state
        runner.finish_requests([f"m{i}" for i in range(batch)])
    return StepTiming(prefill, decode)
