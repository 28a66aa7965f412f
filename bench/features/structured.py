"""What structured outputs cost: the grammar's share of a decode step, and compile time per schema.

    python -m cadenza.bench.features.structured [--model PATH] [--batch 1 32] [--steps 32]

Drives `ModelRunner.execute` directly (no actors; as `model_step` does) over the deployment's
default model, first with free requests, then with every request constrained by a JSON schema,
timing the `structured_output` processor's `apply` (catch-up, llguidance's bitmask, the masking
op) inside the real steps. Compile times are for fresh grammars (an empty cache) with the model's
vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# A schema whose strings and arrays keep the grammar open for the whole run (a completed grammar
# allows only EOS, which would make the mask trivially cheap), with a realistic mix of states.
OPEN_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "count": {"type": "integer"},
                           "kind": {"enum": ["tool", "fruit", "city"]}, "note": {"type": "string"}},
            "required": ["name", "count", "kind", "note"]}},
    },
    "required": ["items"],
}  # fmt: skip

COMPILE_SCHEMAS = {
    "small object": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]},
    "nested (open schema)": OPEN_SCHEMA,
    "50 properties": {"type": "object", "properties": {f"field_{i}": {"type": ["string", "number", "boolean"]} for i in range(50)},
                      "required": [f"field_{i}" for i in range(0, 50, 2)]},
    "regex": None,
}  # fmt: skip


def _steps(runtime, batch: int, steps: int, params, seed: int) -> tuple[float, float]:
    """Mean decode step seconds, and mean seconds the structured processor's apply took per step."""
    from cadenza.bench.common.workload import random_prompt
    from cadenza.step import ScheduledChunk

    runner, block_size = runtime.runner, runtime.block_size
    processor = next((p for p in runner.sampling_pipeline.processors if p.name == "structured_output"), None)
    applied: list[float] = []
    if processor is not None:
        apply = processor.apply

        def timed(logits, b):
            started = time.perf_counter()
            try:
                return apply(logits, b)
            finally:
                applied.append(time.perf_counter() - started)

        processor.apply = timed
    prompt_len = 16
    per_seq = -(-(prompt_len + steps + 2) // block_size)
    vocab = runtime.loaded.arch.vocab_size
    prompts = [random_prompt(prompt_len, seed=seed * 1000 + i, vocab_size=vocab) for i in range(batch)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    ids = [f"s{seed}-{i}" for i in range(batch)]
    last = []
    for i in range(batch):
        result = runner.execute([ScheduledChunk(ids[i], prompts[i], 0, tables[i], True, params, prompts[i])])
        last.append(int(result.sampled.token_ids[0]))
    applied.clear()
    timings = []
    for step in range(steps):
        chunks = [ScheduledChunk(ids[i], [last[i]], prompt_len + step, tables[i], True, params, prompts[i]) for i in range(batch)]
        started = time.perf_counter()
        result = runner.execute(chunks)
        timings.append(time.perf_counter() - started)
        if result.failed:
            raise RuntimeError(f"requests failed in the benchmark: {result.failed[:2]}")
        last = result.sampled.token_ids.tolist()
    runner.finish_requests(ids)
    if processor is not None:
        del processor.apply
    skip = min(2, steps - 1)  # the first steps warm caches (llguidance builds lexer states lazily)
    mean_apply = statistics.mean(applied[skip:]) if applied else 0.0
    return statistics.mean(timings[skip:]), mean_apply


def compile_times(runtime) -> dict[str, float]:
    """Milliseconds to compile each schema into a fresh matcher with the model's vocabulary."""
    from cadenza.samplers.grammars import GrammarCompiler
    from cadenza.sampling_params import StructuredOutputs

    processor = next(p for p in runtime.runner.sampling_pipeline.processors if p.name == "structured_output")
    out = {}
    for name, schema in COMPILE_SCHEMAS.items():
        spec = StructuredOutputs(regex=r"[a-z]+@[a-z]+\.(com|org)") if schema is None else StructuredOutputs(json_schema=schema)
        compiler = GrammarCompiler(processor.compiler.tokenizer)  # empty cache
        started = time.perf_counter()
        compiler.compile(spec)
        out[name] = (time.perf_counter() - started) * 1000
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cadenza.bench.features.structured", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded model)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)

    from cadenza.config import load_config
    from cadenza.runtime.build import build_runtime
    from cadenza.sampling_params import SamplingParams

    overrides = {"cache.num_blocks": 1024, "scheduler.max_num_seqs": max(args.batch)}
    if args.model:
        overrides["model.path"] = args.model
    runtime = build_runtime(load_config(None, overrides=overrides, env={}))
    free = SamplingParams(temperature=1.0, max_tokens=args.steps + 2, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, max_tokens=args.steps + 2, structured_outputs={"json": OPEN_SCHEMA})
    results: dict = {"vocab_size": runtime.loaded.arch.vocab_size, "batches": {}}
    for batch in args.batch:
        free_step, _ = _steps(runtime, batch, args.steps, free, seed=1)
        step, apply = _steps(runtime, batch, args.steps, constrained, seed=2)
        results["batches"][batch] = {
            "free_step_ms": free_step * 1000, "constrained_step_ms": step * 1000,
            "constraint_ms_per_step": apply * 1000, "constraint_us_per_token": apply / batch * 1e6,
            "constraint_share_of_step": apply / step,
        }  # fmt: skip
    results["compile_ms"] = compile_times(runtime)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"vocabulary: {results['vocab_size']} tokens")
    for batch, r in results["batches"].items():
        print(f"batch {batch:>3}: decode step {r['free_step_ms']:.1f} ms free, {r['constrained_step_ms']:.1f} ms constrained; "
              f"constraint {r['constraint_ms_per_step']:.2f} ms/step = {r['constraint_us_per_token']:.0f} us/token "
              f"= {100 * r['constraint_share_of_step']:.1f}% of the step")  # fmt: skip
    for name, ms in results["compile_ms"].items():
        print(f"compile {name}: {ms:.2f} ms")


if __name__ == "__main__":
    main()
