"""transformers as a peer: `generate` over static batches (plain, and with transformers' static
cache and `torch.compile`) and continuous batching (`generate_batch`).

All load the very weights cadenza runs: an HF directory as it is, a .gguf file through
`from_pretrained(dir, gguf_file=name)`, which de-quantizes to the same dtype, and for
`load_format` dummy the same random weights (`fill_module`) in a model built from the config.json.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from cadenza.bench.common.device import synchronize
from cadenza.bench.common.engines import EngineRun
from cadenza.bench.common.workload import Workload, random_prompt

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(source: str | Path, dtype: str, *, device: str | torch.device = "cpu", load_format: str = "auto",
                  seed: int = 0):
    """The transformers model, in eval mode on `device`, for an HF directory or a .gguf file, or
    (`load_format` "dummy") for a config.json or shipped shape, filled with cadenza's dummy weights
    of `seed`."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # generation-flag chatter on every call
    transformers.logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    device = torch.device(device)
    if load_format == "dummy":
        return _dummy_hf_model(source, _DTYPES[dtype], device, seed)
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=_DTYPES[dtype])
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
    return model.to(device).eval()


def _dummy_hf_model(source, dtype: torch.dtype, device: torch.device, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    from cadenza.models.dummy import fill_module, read_dummy_arch, read_dummy_config

    raw, _ = read_dummy_config(source)
    raw = dict(raw)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device(device):  # built and initialised where it runs: no host copy of an 8B model
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to(device)
    fill_module(model, read_dummy_arch(source)[0], seed)  # each tensor drawn on `device`, as cadenza's were
    return model.eval()


def static_compile_kwargs(device: torch.device) -> dict:
    """`generate`'s arguments for transformers' own fast path (its "static cache and torch.compile"):
    a `StaticCache`, and the decode step compiled by `generate` itself with `CompileConfig` (mode
    "reduce-overhead": CUDA graphs); prefill stays eager. `generate` compiles only on accelerators
    unless the config says otherwise (`_compile_all_devices`, transformers' switch for tests)."""
    from transformers import CompileConfig

    config = CompileConfig(mode="reduce-overhead")
    if device.type != "cuda":
        config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


def size_static_cache(model, length: int) -> None:
    """Make `generate`'s next static cache `length` tokens long (longer if the call needs more).

    transformers keeps the longest it has made (`_previous_max_cache_length`) and makes every later
    one at least as long, so that the compiled step is not recompiled; each measure here sizes its
    own instead, as a user timing only that shape would (after a prefill of 1024, a batch of 256
    would otherwise attend over 1025 slots, and hold a cache that long)."""
    model._previous_max_cache_length = length


def no_grad(compiled: bool):
    """inference_mode for eager calls; no_grad (what `generate` itself uses) around compiled ones,
    whose CUDA graphs keep the static cache's tensors across calls."""
    return torch.no_grad() if compiled else torch.inference_mode()


def greedy_agreement(engine, model, *, prompt_len: int = 16, num_tokens: int = 8, seed: int = 0) -> dict:
    """cadenza's and transformers' greedy tokens after one random prompt, and how many agree from
    the first: the same weights give the same tokens in float32 (in 16-bit a near tie among random
    weights' logits may break either way)."""
    from cadenza.sampling_params import SamplingParams
    from cadenza.threads import compute_thread

    prompt = random_prompt(prompt_len, seed=seed, vocab_size=engine.arch.vocab_size)
    _, done = engine.generate([prompt], [SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)])
    ours = list(done[0].token_ids)
    theirs = compute_thread.run_sync(_hf_greedy, model, prompt, num_tokens)
    equal = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return {"prompt_tokens": prompt_len, "num_tokens": num_tokens, "equal_from_start": equal,
            "cadenza": ours, "hf": theirs}


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                         min_new_tokens=num_tokens, pad_token_id=_pad_id(model), do_sample=False)
    return out[0, len(prompt):].tolist()


def same_weights_check(engine, model) -> dict:
    """`greedy_agreement`, or what stopped it: a check, never a reason to stop the bench."""
    try:
        return greedy_agreement(engine, model)
    except Exception as exc:
        return {"error": repr(exc)}


def describe_agreement(check: dict) -> str:
    if "error" in check:
        return f"same weights: not checked ({check['error']})"
    return (f"same weights: greedy tokens after a {check['prompt_tokens']}-token prompt, cadenza and transformers "
            f"agree on the first {check['equal_from_start']} of {check['num_tokens']}")


def _pad_id(model) -> int:
    cfg = model.config
    for candidate in (cfg.pad_token_id, cfg.eos_token_id, 0):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def _sampling_kwargs(temperature: float) -> dict:
    if temperature <= 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


class HFStaticEngine:
    """`model.generate` on consecutive batches of `batch_size` requests in workload order.

    Prompts are left-padded to the batch's longest; every row runs to the batch's longest output
    (EOS held off by `min_new_tokens`), so the surplus is computed and not counted as output.
    `compiled`: with transformers' static cache and compiled decode step (`static_compile_kwargs`),
    one cache length for the whole workload; each batch size is compiled in the warm-up.
    """

    def __init__(self, model, batch_size: int = 32, *, compiled: bool = False) -> None:
        self.model = model
        self.batch_size = batch_size
        self.compiled = compiled
        self.name = "hf-compiled" if compiled else "hf-static"
        self.extra = static_compile_kwargs(model.device) if compiled else {}

    def run(self, workload: Workload) -> EngineRun:
        requests = workload.requests
        pad = _pad_id(self.model)
        batches = [requests[i : i + self.batch_size] for i in range(0, len(requests), self.batch_size)]
        self.cache_len = max(max(len(r.prompt_token_ids) for r in b) + max(r.max_tokens for r in b) for b in batches)
        for size in sorted({len(b) for b in batches}) if self.compiled else [len(batches[0])]:
            self._generate(requests[:size], 4, pad, workload.temperature)  # warm up (and compile)
        computed = 0
        synchronize(self.model.device)
        started = time.perf_counter()
        for batch in batches:
            new_tokens = max(r.max_tokens for r in batch)
            produced = self._generate(batch, new_tokens, pad, workload.temperature)
            if produced != new_tokens:
                raise RuntimeError(f"{self.name}: asked for {new_tokens} new tokens, got {produced}")
            computed += new_tokens * len(batch)
        synchronize(self.model.device)
        seconds = time.perf_counter() - started
        return EngineRun(
            engine=f"{self.name} (batch {self.batch_size})",
            seconds=seconds,
            num_prompt_tokens=workload.num_prompt_tokens,
            num_output_tokens=workload.num_output_tokens,
            num_computed_tokens=computed,
            note=f"computed {computed} output tokens for {workload.num_output_tokens} asked",
        )

    def _generate(self, batch, new_tokens: int, pad: int, temperature: float) -> int:
        with no_grad(self.compiled):
            return self._generate_batch(batch, new_tokens, pad, temperature)

    def _generate_batch(self, batch, new_tokens: int, pad: int, temperature: float) -> int:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - n :] = 1
        if self.compiled:
            size_static_cache(self.model, self.cache_len)
        out = self.model.generate(
            input_ids=ids.to(self.model.device),
            attention_mask=mask.to(self.model.device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
            **_sampling_kwargs(temperature),
            **self.extra,
        )
        return out.shape[1] - width


def has_continuous_batching(model) -> bool:
    return hasattr(model, "continuous_batching_context_manager") and hasattr(model, "generate_batch")


class HFContinuousEngine:
    """transformers' continuous batching: each request with its own `max_new_tokens`, EOS off.

    The manager (its paged cache and worker thread) is built before the clock starts, as
    `generate_batch` would; one short request warms it up.
    """

    name = "hf-continuous"

    def __init__(self, model) -> None:
        self.model = model

    def run(self, workload: Workload) -> EngineRun:
        from transformers import GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        requests = workload.requests
        config = GenerationConfig(
            max_new_tokens=max(r.max_tokens for r in requests), pad_token_id=_pad_id(self.model),
            **_sampling_kwargs(workload.temperature),
        )
        hints = WorkloadHints(
            max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
            max_generated_length=config.max_new_tokens,
            num_requests=len(requests),
        )
        with self.model.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=60, workload_hints=hints
        ) as manager:
            self._wait(manager, {manager.add_request(list(range(100, 116)), "warmup", max_new_tokens=4, eos_token_id=-1)})
            started = time.perf_counter()
            ids = {
                manager.add_request(r.prompt_token_ids, f"bench-{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
                for i, r in enumerate(requests)
            }
            results = self._wait(manager, ids)
            seconds = time.perf_counter() - started
        produced = sum(len(r.generated_tokens) for r in results.values())
        failed = [r.error for r in results.values() if r.error]
        note = f"{len(failed)} requests failed: {failed[0]}" if failed else ""
        if produced != workload.num_output_tokens:
            note = (note + "; " if note else "") + f"produced {produced} tokens, asked {workload.num_output_tokens}"
        return EngineRun(
            engine=self.name,
            seconds=seconds,
            num_prompt_tokens=workload.num_prompt_tokens,
            num_output_tokens=produced,
            num_computed_tokens=produced,
            note=note,
        )

    @staticmethod
    def _wait(manager, ids: set, timeout: float = 3600.0) -> dict:
        results, deadline = {}, time.monotonic() + timeout
        while len(results) < len(ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"hf-continuous: {len(ids) - len(results)} requests unfinished after {timeout}s")
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("hf-continuous: the generation thread stopped")
                continue
            if out.request_id in ids and out.is_finished():
                results[out.request_id] = out
        return results
