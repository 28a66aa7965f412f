"""Time to first token of a long conversation's turns: with prefix reuse, without it, and after a
`drop_oldest` cut. `python -m cadenza.bench.features.sessions [--model PATH] [--turns N] ...`

Runs the conversation core (`api/sessions/core.py`: chat template, context policy) on an in-process
engine, twice with the same greedy turns: once with the prefix cache, once without. Every turn's
prompt is the whole conversation, so without reuse its prefill grows with the history; with reuse
only the new tokens are computed, until a cut changes everything after the system prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from dataclasses import asdict, dataclass

from cadenza.api.metrics import ServerMetrics
from cadenza.api.sessions.conversation import Conversation
from cadenza.api.sessions.core import ContextPlugins, ContextSettings, SessionCore
from cadenza.api.state import ServerState
from cadenza.config import load_config
from cadenza.config.logging_setup import configure_logging
from cadenza.engine.async_engine import AsyncEngine
from cadenza.runtime.build import build_runtime
from cadenza.sampling_params import SamplingParams

SYSTEM = "You are a patient tutor who explains how language model servers work, step by step."
QUESTION = ("Question {i}: explain, in your own words, how a paged KV cache lets a server keep many long "
            "conversations in memory at once, and what a prefix cache saves on the next turn.")  # fmt: skip


@dataclass(slots=True)
class TurnRow:
    turn: int
    prefix_cache: bool
    prompt_tokens: int
    cached_tokens: int
    cut: bool
    turns_dropped: int
    ttft_ms: float


async def run_session(config, turns: int, max_tokens: int) -> list[TurnRow]:
    runtime = build_runtime(config)
    rows = []
    async with AsyncEngine.serve(runtime) as engine:
        state = ServerState(engine, config, "bench", ServerMetrics(engine.metrics))
        core = SessionCore(state, ContextPlugins(config, runtime.registries))
        conversation = Conversation(SYSTEM)
        settings = ContextSettings("drop_oldest")
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        # Warm-up (kernels built, first-call allocations), on token ids no turn shares.
        async for _ in engine.generate([11] * 300, SamplingParams(max_tokens=4), request_id="warm-up"):
            pass
        for i in range(turns):
            prepared = await core.prepare(conversation, [{"role": "user", "content": QUESTION.format(i=i)}], params,
                                          settings, session_id="bench", request_id=f"t{i}")  # fmt: skip
            text, last = [], None
            async for out in engine.generate(prepared.token_ids, params, request_id=f"t{i}"):
                text.append(out.text)
                last = out
            core.settle(conversation, prepared, {"role": "assistant", "content": "".join(text)})
            rows.append(TurnRow(i, config.cache.enable_prefix_caching, last.num_prompt_tokens, last.num_cached_tokens,
                                prepared.cut, prepared.turns_dropped, round(last.timings.ttft_seconds * 1000, 1)))  # fmt: skip
    return rows


def summarize(reuse: list[TurnRow], fresh: list[TurnRow]) -> dict:
    first_cut = next((r.turn for r in reuse if r.cut), None)
    before = first_cut - 1 if first_cut is not None else reuse[-1].turn
    after_cut = [r for r in reuse if r.turn > (first_cut or len(reuse)) and not r.cut]
    return {
        "turn_before_first_cut": before,
        "ttft_ms_with_reuse": reuse[before].ttft_ms,
        "ttft_ms_without_reuse": fresh[before].ttft_ms,
        "prompt_tokens": reuse[before].prompt_tokens,
        "cached_tokens_with_reuse": reuse[before].cached_tokens,
        "cut_turn": first_cut,
        "ttft_ms_cut_turn": reuse[first_cut].ttft_ms if first_cut is not None else None,
        "cached_tokens_cut_turn": reuse[first_cut].cached_tokens if first_cut is not None else None,
        "ttft_ms_without_reuse_same_turn": fresh[first_cut].ttft_ms if first_cut is not None else None,
        "median_ttft_ms_after_cut_with_reuse": statistics.median(r.ttft_ms for r in after_cut) if after_cut else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cadenza.bench.features.sessions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path; default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    parser.add_argument("--json", action="store_true", help="print every turn as JSON lines")
    args = parser.parse_args(argv)
    configure_logging("warning", "console")
    results = {}
    for reuse in (True, False):
        overrides = {"model.path": args.model, "model.max_model_len": args.max_model_len, "cache.enable_prefix_caching": reuse}
        config = load_config(None, overrides=overrides, env={})
        results[reuse] = asyncio.run(run_session(config, args.turns, args.max_tokens))
    if args.json:
        for row in results[True] + results[False]:
            print(json.dumps(asdict(row)))
    print(f"{'turn':>4} {'prompt':>6} {'cached':>6} {'cut':>4} {'ttft reuse ms':>13} {'ttft no-reuse ms':>16}")
    for a, b in zip(results[True], results[False]):
        cut = f"-{a.turns_dropped}" if a.cut else ""
        print(f"{a.turn:>4} {a.prompt_tokens:>6} {a.cached_tokens:>6} {cut:>4} {a.ttft_ms:>13} {b.ttft_ms:>16}")
    print(json.dumps(summarize(results[True], results[False]), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
