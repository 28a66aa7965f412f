"""`python -m cadenza.bench.speculative`: batch-1 decode speed with and without speculative decoding.

Two workloads, each request run alone (batch 1), greedy, every method on the same prompts in turn:

- **edit**: "rewrite this passage with the typos fixed", where the answer repeats most of the
  prompt: what prompt lookup (`ngram`) and `suffix` are for;
- **random**: random token-id prompts (ignore EOS): little repeats, so speculation must switch
  itself off (the adaptive policy) and cost next to nothing.

One engine serves every method (each request picks its proposer, or none, through
`SamplingParams.speculative`), so the model loads once; `--draft` adds the draft-model proposer. Decode speed is tokens after the
first over the time after the first (the prompt's prefill is left out). Greedy output is the same
with every method; the report checks it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from cadenza.bench.workload import random_prompt
from cadenza.sampling_params import SamplingParams

PASSAGES = (
    "The comittee met on tuesday to discus the new budjet for the libary. Several members argued that "
    "the funds for new books should be increased, while others beleived that the building itself needed "
    "repairs first. After a long debate, they agreed to split the money evenly betwen the two goals and "
    "to revisit the question next year.",
    "Our hiking trip started early in the moring. We packed sandwitches, water and a map, and followed "
    "the river trail untill it reached the old bridge. From there the path climbed steeply through the "
    "forrest, and by noon we could see the whole valley bellow us, with the village roofs shining in "
    "the sun.",
    "To install the software, first download the latest relase from the website. Unzip the archive into "
    "a folder of your choise, then open a terminal in that folder and run the setup script. The script "
    "will ask for a few settings; the defaults are fine for most users. When it finishs, restart your "
    "computer.",
)
METHODS = ("none", "ngram", "suffix")


def edit_prompts() -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"Rewrite the following text with the spelling mistakes fixed. Reply with "
          f"the corrected text only.\n\n{passage}"}]
        for passage in PASSAGES
    ]  # fmt: skip


def decode_speed(output) -> float:
    timings = output.timings
    tokens = len(output.token_ids)
    if timings is None or timings.ttft_seconds is None or tokens < 2:
        return 0.0
    return (tokens - 1) / max(timings.e2e_seconds - timings.ttft_seconds, 1e-9)


def run_workload(llm, name: str, prompts: list, params: SamplingParams, methods=METHODS, repeats: int = 1) -> dict:
    """Each prompt alone under each method, `repeats` times, methods interleaved (drift hits all)."""
    speeds = {m: [] for m in methods}
    tokens = {m: [] for m in methods}
    spec_before = {m: list(llm.engine.metrics.speculation.get(m, [0, 0, 0])) for m in methods}
    for _ in range(repeats):
        for prompt in prompts:
            for method in methods:
                pick = {"num_tokens": 0} if method == "none" else {"method": method}
                one = SamplingParams(**{**params.model_dump(), "speculative": pick})
                (out,) = llm.generate(prompt, one, use_tqdm=False)
                speeds[method].append(decode_speed(out))
                tokens[method].append(out.token_ids)
    row = {"workload": name, "prompts": len(prompts), "repeats": repeats}
    for method in methods:
        total_tokens = sum(len(t) - 1 for t in tokens[method])
        total_seconds = sum((len(t) - 1) / s for t, s in zip(tokens[method], speeds[method]) if s)
        rate = total_tokens / total_seconds if total_seconds else 0.0
        counts = llm.engine.metrics.speculation.get(method, [0, 0, 0])
        proposed = counts[1] - spec_before[method][1]
        accepted = counts[2] - spec_before[method][2]
        row[method] = {
            "decode_tokens_per_s": round(rate, 2),
            "tokens": total_tokens,
            "proposed": proposed,
            "accepted": accepted,
            "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
            "same_tokens_as_none": tokens[method] == tokens["none"],
        }
    base = row["none"]["decode_tokens_per_s"]
    for method in methods[1:]:
        row[method]["speedup"] = round(row[method]["decode_tokens_per_s"] / base, 3) if base else None
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cadenza.bench.speculative", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="Model path (default: the embedded SmolLM2 GGUF).")
    parser.add_argument("--num-tokens", type=int, default=4, help="speculative.num_tokens.")
    parser.add_argument("--random-prompts", type=int, default=3)
    parser.add_argument("--random-prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=160)
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
        rows = [
            run_workload(llm, "edit", edit_prompts(), SamplingParams(temperature=0, max_tokens=args.max_tokens), methods, args.repeats),
            run_workload(
                llm, "random",
                [random_prompt(args.random_prompt_len, seed=100 + i, vocab_size=vocab) for i in range(args.random_prompts)],
                SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True), methods, args.repeats,
            ),
        ]  # fmt: skip
    for row in rows:
        print(json.dumps(row))
    print(f"# {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
