"""`python -m cadenza.bench.features.speculative`: batch-1 decode speed with and without speculative decoding.

Three workloads, each request run alone (batch 1), every method on the same prompts in turn:

- **edit**: greedy, a document and a small change to make to it, the answer being the whole document
  again (bench/features/edit_workload.py: prose, code, markup and data): what prompt lookup (`ngram`) and
  `suffix` are for. Reported per kind of document too;
- **random**: random token-id prompts (ignore EOS), greedy: nothing to look up at first (the
  small model then falls into loops, which the proposers follow);
- **random-sampled**: the same prompts at temperature 1, seeded: little repeats, few guesses are
  kept, so speculation must switch itself off (the adaptive policy) and cost next to nothing.

One engine serves every method (each request picks its proposer, or none, through
`SamplingParams.speculative`), so the model loads once; `--draft` adds the draft-model proposer. Decode speed is tokens after the
first over the time after the first (the prompt's prefill is left out). Greedy output is the same
with every method, and so is seeded sampled output (verification draws from the request's
generator once per token it emits, as plain decoding does); the report checks it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from cadenza.bench.common.workload import random_prompt
from cadenza.bench.features.edit_workload import TASKS
from cadenza.sampling_params import SamplingParams

METHODS = ("none", "ngram", "suffix")


def decode_speed(output) -> float:
    """Decode tokens a second of an `LLM.generate` result (its one completion) after the first token."""
    timings = output.metrics
    tokens = len(output.outputs[0].token_ids)
    if timings is None or timings.ttft_seconds is None or tokens < 2:
        return 0.0
    return (tokens - 1) / max(timings.e2e_seconds - timings.ttft_seconds, 1e-9)


@dataclass(frozen=True, slots=True)
class Item:
    prompt: object  # text, messages or token ids
    params: SamplingParams
    kind: str = ""


def run_workload(llm, name: str, items: list[Item], methods=METHODS, repeats: int = 1) -> dict:
    """Each item alone under each method, `repeats` times, methods interleaved (drift hits all)."""
    runs = {m: [] for m in methods}  # (item index, decode tokens, seconds, token ids)
    spec_before = {m: list(llm.engine.metrics.speculation.get(m, [0, 0, 0])) for m in methods}
    for _ in range(repeats):
        for index, item in enumerate(items):
            for method in methods:
                pick = {"num_tokens": 0} if method == "none" else {"method": method}
                one = SamplingParams(**{**item.params.model_dump(), "speculative": pick})
                (out,) = llm.generate(item.prompt, one, use_tqdm=False)
                speed = decode_speed(out)
                token_ids = out.outputs[0].token_ids
                tokens = len(token_ids) - 1
                runs[method].append((index, tokens, tokens / speed if speed else 0.0, token_ids))
    row = {"workload": name, "prompts": len(items), "repeats": repeats}
    for method in methods:
        counts = llm.engine.metrics.speculation.get(method, [0, 0, 0])
        proposed = counts[1] - spec_before[method][1]
        accepted = counts[2] - spec_before[method][2]
        row[method] = {
            "decode_tokens_per_s": _rate(runs[method]),
            "tokens": sum(r[1] for r in runs[method]),
            "proposed": proposed,
            "accepted": accepted,
            "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
            "same_tokens_as_none": [r[3] for r in runs[method]] == [r[3] for r in runs["none"]],
        }
    base = row["none"]["decode_tokens_per_s"]
    for method in methods[1:]:
        row[method]["speedup"] = round(row[method]["decode_tokens_per_s"] / base, 3) if base else None
    kinds = sorted({item.kind for item in items if item.kind})
    if len(kinds) > 1:  # speedups per kind of prompt, over the same runs
        row["by_kind"] = {}
        for kind in kinds:
            rates = {m: _rate([r for r in runs[m] if items[r[0]].kind == kind]) for m in methods}
            row["by_kind"][kind] = {
                "prompts": sum(item.kind == kind for item in items),
                **{m: round(rates[m] / rates["none"], 3) if rates["none"] else None for m in methods[1:]},
            }
    return row


def _rate(runs: list[tuple]) -> float:
    tokens, seconds = sum(r[1] for r in runs if r[2]), sum(r[2] for r in runs)
    return round(tokens / seconds, 2) if seconds else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cadenza.bench.features.speculative", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="Model path (default: the embedded SmolLM2 GGUF).")
    parser.add_argument("--num-tokens", type=int, default=16, help="speculative.num_tokens.")
    parser.add_argument("--random-prompts", type=int, default=3)
    parser.add_argument("--random-prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=160, help="Tokens a random prompt decodes.")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--draft", action="store_true",
        help="Also the draft-model proposer: the same GGUF with its native Q4 blocks drafting for this "
        "deployment (add --set model.quantization=none for a float target).",
    )  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Extra config overrides.")
    args = parser.parse_args(argv)

    from cadenza.llm import LLM

    # No prefix cache: a prompt run again recomputes exactly as the first time, so every method
    # starts from the same prompt state (a cached prefix changes the prefill's shape and its numerics).
    overrides = {"speculative.num_tokens": args.num_tokens, "logging.level": "warning", "cache.enable_prefix_caching": False}
    methods = METHODS
    if args.draft:
        overrides["speculative.method"] = "draft"
        methods = (*METHODS, "draft")
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = value
    started = time.perf_counter()
    with LLM(args.model, **overrides) as llm:
        vocab = llm.runtime.loaded.arch.vocab_size
        llm.generate("Warm up.", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        tokenizer = llm.runtime.tokenizer
        edits = [Item(t.messages(), SamplingParams(temperature=0, max_tokens=t.max_tokens(tokenizer)), t.kind) for t in TASKS]
        randoms = [
            Item(random_prompt(args.random_prompt_len, seed=100 + i, vocab_size=vocab),
                 SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
            for i in range(args.random_prompts)
        ]  # fmt: skip
        # The same prompts sampled at temperature 1 (seeded): the text no longer loops, few guesses
        # are kept, and the adaptive policy must keep speculation from costing anything.
        sampled = [
            Item(item.prompt, SamplingParams(**{**item.params.model_dump(), "temperature": 1.0, "seed": 7 + i}))
            for i, item in enumerate(randoms)
        ]
        rows = [
            run_workload(llm, "edit", edits, methods, args.repeats),
            run_workload(llm, "random", randoms, methods, args.repeats),
            run_workload(llm, "random-sampled", sampled, methods, args.repeats),
        ]
    for row in rows:
        print(json.dumps(row))
    print(f"# {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
