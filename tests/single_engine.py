"""What one engine in this process generates: the reference the multi-process tests (torchrun
nodes, Ray nodes) compare their served tokens against."""

from __future__ import annotations

import anyio

from cadenza.config import load_config
from cadenza.engine.async_engine import AsyncEngine
from cadenza.runtime.build import build_runtime
from cadenza.sampling_params import SamplingParams


def greedy_texts(overrides: dict, prompts: list, max_tokens: int) -> list[str]:
    """Each prompt's greedy text (ignore_eos, `max_tokens`), one after another, on one engine
    configured by `overrides`; a request that errs fails the caller's test."""
    runtime = build_runtime(load_config(None, overrides=overrides, env={}))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def run() -> list[str]:
        texts = []
        async with AsyncEngine.serve(runtime) as engine:
            for prompt in prompts:
                text = ""
                async for out in engine.generate(prompt, params):
                    assert out.finish_reason != "error", out.error
                    text += out.text
                texts.append(text)
        return texts

    try:
        return anyio.run(run)
    finally:
        runtime.close()
