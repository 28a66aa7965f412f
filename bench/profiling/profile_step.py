"""Where a model step's time goes: torch.profiler over `ModelRunner.execute`, no engine around it.

    .venv/bin/python -m cadenza.bench.profiling.profile_step [--model PATH] [--dtype bfloat16] [--batch 1] \
        [--context 64] [--steps 20] [--prefill 512]

Prints the wall time per decode step (without the profiler), then, from a profiled pass, the time
per step in each part of the model (labelled here by wrapping modules and functions at run time,
no source edited) and the aten ops with the most self time. The profiler itself adds a few
microseconds per op, so shares matter more than its absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

LABELS: set[str] = set()


def label(fn, name):
    LABELS.add(name)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapped


class _Labelled:
    """A callable object labelled like `label`, its other attributes passed through."""

    def __init__(self, target, name: str) -> None:
        LABELS.add(name)
        self._target, self._name = target, name

    def __call__(self, *args, **kwargs):
        with record_function(self._name):
            return self._target(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._target, attr)


def instrument(runtime) -> None:
    """Label the parts of a step: projections, norms, rotary, attention pieces, sampling, packing."""
    import cadenza.attention_backends.torch_sdpa as sdpa
    import cadenza.models.llama as llama

    model, runner = runtime.loaded.model, runtime.runner
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "DualPrecisionLinear":
            module.forward = label(module.forward, f"linear.{leaf}")
        elif isinstance(module, llama.RMSNorm):
            module.forward = label(module.forward, "rmsnorm")
        elif isinstance(module, llama.MLP):
            module.forward = label(module.forward, "mlp (incl. its linears)")
        elif isinstance(module, torch.nn.Embedding):
            module.forward = label(module.forward, "embedding")
    import cadenza.models.rotary as rotary

    rotary.StepRotary.rotate = label(rotary.StepRotary.rotate, "rotary.apply")
    model.rotary.cos_sin = label(model.rotary.cos_sin, "rotary.cos_sin")
    sdpa.write_kv = label(sdpa.write_kv, "attention.write_kv")
    sdpa.F.scaled_dot_product_attention = label(torch.nn.functional.scaled_dot_product_attention, "attention.sdpa")
    backend = runner.backend
    backend.forward = label(backend.forward, "attention (all: write, gather, sdpa)")
    backend.begin_step = label(backend.begin_step, "attention.begin_step (masks)")
    runner.sampling_pipeline = _Labelled(runner.sampling_pipeline, "sampling pipeline")
    runner._packer.pack = label(runner._packer.pack, "step_inputs.pack (packing)")
    model.compute_logits = label(model.compute_logits, "compute_logits (lm_head)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prefill", type=int, default=0, help="profile one prefill of this length instead")
    parser.add_argument("--num-threads", type=int)
    args = parser.parse_args()

    from cadenza.bench.common.engines import CadenzaEngine
    from cadenza.bench.offline.model_step import time_model_steps
    from cadenza.config.logging_setup import configure_logging

    configure_logging("warning", "console")
    engine = CadenzaEngine(args.model, dtype=args.dtype, num_threads=args.num_threads)
    rt = engine.runtime

    def run(seed: int, prof=None):
        if args.prefill:
            if prof is None:
                return time_model_steps(rt, batch=1, prompt_len=args.prefill, decode_steps=1, temperature=0.6, seed=seed)
            with prof:
                return time_model_steps(rt, batch=1, prompt_len=args.prefill, decode_steps=1, temperature=0.6, seed=seed)
        return time_model_steps(rt, batch=args.batch, prompt_len=args.context, decode_steps=args.steps,
                                temperature=0.6, seed=seed, around_decode=(lambda: prof) if prof else contextlib.nullcontext)

    run(0)  # warm up
    timings = [run(s) for s in (1, 2, 3)]
    if args.prefill:
        wall = min(t.prefill_seconds for t in timings)
        what = f"prefill of {args.prefill} tokens"
    else:
        wall = min(t.decode_step_seconds for t in timings)
        what = f"decode step, batch {args.batch}, context {args.context}"
    print(f"{what}: {wall * 1e3:.2f} ms wall (best of 3, no profiler)")

    instrument(rt)
    prof = profile(activities=[ProfilerActivity.CPU])
    timing = run(9, prof)
    events = prof.key_averages()
    per = 1 if args.prefill else args.steps

    def ms(us: float) -> float:  # per step
        return us / 1e3 / per

    step_ms = (timing.prefill_seconds if args.prefill else timing.decode_step_seconds) * 1e3
    print(f"profiled: {step_ms:.2f} ms per step with the profiler on"
          + (" (the profile holds the prefill and one decode step)" if args.prefill else ""))
    labelled = sorted((e for e in events if e.key in LABELS), key=lambda e: -e.cpu_time_total)
    print("\nparts (inclusive ms per step; nested parts overlap):")
    for e in labelled:
        print(f"  {e.key:42s} {ms(e.cpu_time_total):8.3f}  ({e.count / per:.0f} calls/step)")
    aten = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)
    total_self = sum(e.self_cpu_time_total for e in aten)
    ops = sum(e.count for e in aten)
    print(f"\naten ops: {ops / per:.0f} per step, {ms(total_self):.2f} ms self time per step; top by self time:")
    for e in aten[:15]:
        print(f"  {e.key:42s} {ms(e.self_cpu_time_total):8.3f}  ({e.count / per:.0f}/step)")
    groups = defaultdict(float)
    for e in aten:
        groups[_group(e.key)] += e.self_cpu_time_total
    print("\naten self time by kind (ms per step):")
    for k, v in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {k:42s} {ms(v):8.3f}")


def _group(op: str) -> str:
    if op in ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm", "aten::mkldnn_linear"):
        return "matmul"
    if "scaled_dot_product" in op or "flash_attention" in op or op in ("aten::_softmax",):
        return "sdpa / softmax"
    if op in ("aten::index", "aten::index_select", "aten::index_copy_", "aten::index_put_", "aten::gather"):
        return "indexing (KV gather/write, row picks)"
    if op in ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::empty", "aten::zeros",
              "aten::empty_strided", "aten::new_zeros", "aten::fill_", "aten::zero_", "aten::full"):
        return "copies, casts, allocation"
    return "elementwise and other"


if __name__ == "__main__":
    from cadenza.threads import compute_thread

    # The model loads on the compute thread; stepping it from another thread would bring a second
    # OpenMP team that fights the first for the cores (threads/compute_thread.py), and time that instead.
    compute_thread.run_sync(main)
