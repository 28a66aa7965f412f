"""Where a bench runs: the device, its clock, and the engine settings the bench's work needs.

A GPU queues work and returns at once, so a host clock read after a call measures only the
queueing: every timing here waits for the device first (`synchronize`), and a kernel timed alone
reads CUDA events around it (`elapsed_seconds`). Nothing here needs a GPU to import or to test.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

CUDA_ATTENTION_BACKEND = "triton"  # cadenza's attention backend on CUDA, unless --attention-backend or the config names one
GPU_MEMORY_SHARE = 0.9  # of the free GPU memory at start: what the bench lets its engines take together
KV_HEADROOM_BLOCKS = 8  # beyond the work's own: the warm-up request's blocks


def synchronize(device: torch.device) -> None:
    """Wait until `device` has done everything queued on it; nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds `fn`'s work takes: on a GPU, between CUDA events recorded around it on the current
    stream (queued work before it excluded); on the CPU, by the host clock."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # milliseconds
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def best_seconds(fn: Callable[[], object], *, min_reps: int = 3, min_seconds: float = 0.3,
                 device: torch.device = torch.device("cpu")) -> float:
    """The best of at least `min_reps` timings of `fn` (`elapsed_seconds`) taken over at least
    `min_seconds`, after one warm-up call (page faults, packed weights, thread pool, kernel choice)."""
    fn()
    synchronize(device)
    best, reps, started = float("inf"), 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - started < min_seconds:
        best = min(best, elapsed_seconds(fn, device))
        reps += 1
    return best


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda})"
    return "cpu"


@dataclass(frozen=True, slots=True)
class WorkNeeds:
    """What a bench asks of cadenza's engine at once: `lengths`, the whole length (prompt and
    output) of each sequence held at the same time; `alone`, the longest one run by itself."""

    lengths: tuple[int, ...]
    alone: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    def num_blocks(self, block_size: int) -> int:
        held = sum(-(-n // block_size) for n in self.lengths)
        return max(held, -(-self.alone // block_size)) + KV_HEADROOM_BLOCKS


def kv_blocks_for(needs: WorkNeeds, block_size: int, bytes_per_block: int, *, free_bytes: int, weight_bytes: int,
                  with_hf: bool) -> tuple[int, str]:
    """KV cache blocks for a GPU run: what the work holds at once, capped by the free memory once
    the weights are in (cadenza's, and transformers' beside it, which then keeps half the rest for
    its own cache); and a note when the cap bites."""
    room = GPU_MEMORY_SHARE * free_bytes - (2 if with_hf else 1) * weight_bytes
    cap = int(room * (0.5 if with_hf else 1.0)) // bytes_per_block
    need = needs.num_blocks(block_size)
    if cap < 1:
        raise ValueError(f"the GPU has {free_bytes / 2**30:.1f} GiB free, too little for "
                         f"{'two copies of ' if with_hf else ''}{weight_bytes / 2**30:.1f} GiB of weights and a KV cache")
    if need <= cap:
        return need, ""
    return cap, (f"the KV cache holds {cap} of the {need} blocks the work needs at once "
                 f"({cap * bytes_per_block / 2**30:.1f} GiB); cadenza queues or preempts the rest")


@dataclass(slots=True)
class EnginePlan:
    """cadenza's config overrides for a bench run, the device they resolve to, and why any was chosen."""

    device: torch.device
    overrides: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """cadenza's config keys the bench's flags set (None: not given)."""
    from cadenza.bench.common.setup import ENGINE_FLAGS
    from cadenza.config import flags

    engine = {flags.BY_FLAG[f].path: getattr(args, flags.BY_FLAG[f].dest, None) for f in ENGINE_FLAGS}
    return {"model.seed": args.seed, "model.quantization": args.quantization, **engine}


def read_bench_config(args: argparse.Namespace):
    """(the config the flags and `--config` give, the model's shape read without its weights)."""
    from cadenza.config import load_config
    from cadenza.models.loading import load_tokenizer

    config = load_config(args.config, overrides={"model.path": args.model, "model.dtype": args.dtype,
                                                 **flag_overrides(args)})
    arch, _, _ = load_tokenizer(config.model.path, load_format=config.model.load_format)
    return config, arch


def plan_engine(args: argparse.Namespace, config, arch, needs: WorkNeeds) -> EnginePlan:
    """The flags as config overrides, and what the work needs that `config` would not give.

    Every device: `scheduler.max_num_seqs` is raised to the work's batch when lower (a batch of 256
    then runs as one). On CUDA: the attention backend defaults to `CUDA_ATTENTION_BACKEND`, and
    unless `--kv-cache-memory` or the config sizes the cache, `cache.num_blocks` holds the whole
    work at once (`kv_blocks_for`). On the CPU the cache keeps the engine's default size.
    """
    from cadenza.runner.device import resolve_device

    device = resolve_device(config.model.device)
    plan = EnginePlan(device, {k: v for k, v in flag_overrides(args).items() if v is not None})
    if args.max_num_seqs is None and needs.num_seqs > config.scheduler.max_num_seqs:
        plan.overrides["scheduler.max_num_seqs"] = needs.num_seqs
        plan.notes.append(f"scheduler.max_num_seqs {needs.num_seqs}: the work's batch (the config's is "
                          f"{config.scheduler.max_num_seqs})")
    if device.type != "cuda":
        return plan
    if "attention_backend" not in config.model_fields_set:
        plan.overrides["attention_backend"] = CUDA_ATTENTION_BACKEND
    if config.cache.num_blocks is None and config.cache.memory_budget is None:
        blocks, note = _cuda_kv_blocks(config, arch, device, needs, with_hf="hf" in args.compare)
        plan.overrides["cache.num_blocks"] = blocks
        plan.notes.append(note or f"cache.num_blocks {blocks}: the work's sequences all at once")
    return plan


def _cuda_kv_blocks(config, arch, device: torch.device, needs: WorkNeeds, with_hf: bool) -> tuple[int, str]:
    from cadenza.models.dummy import num_parameters
    from cadenza.runner.device import resolve_dtype, resolve_kv_dtype
    from cadenza.runner.kv_cache import bytes_per_block

    dtype = resolve_dtype(config.model.dtype)
    per_block = bytes_per_block(arch, config.cache.block_size, resolve_kv_dtype(config.cache.dtype, dtype))
    free, _ = torch.cuda.mem_get_info(device)
    return kv_blocks_for(needs, config.cache.block_size, per_block, free_bytes=free,
                         weight_bytes=num_parameters(arch) * dtype.itemsize, with_hf=with_hf)
