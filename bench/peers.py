"""transformers as a peer: `generate` over static batches and continuous batching (`generate_batch`).

Both load the very weights cadenza runs: an HF directory as it is, a .gguf file through
`from_pretrained(dir, gguf_file=name)`, which de-quantizes to the same dtype.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from cadenza.bench.engines import EngineRun
from cadenza.bench.workload import Workload

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(source: str | Path, dtype: str):
    """The transformers model for an HF directory or a .gguf file, in eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # generation-flag chatter on every call
    transformers.logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=_DTYPES[dtype])
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
    return model.eval()


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
    """

    name = "hf-static"

    def __init__(self, model, batch_size: int = 32) -> None:
        self.model = model
        self.batch_size = batch_size

    def run(self, workload: Workload) -> EngineRun:
        requests = workload.requests
        pad = _pad_id(self.model)
        self._generate(requests[:1], 4, pad, workload.temperature)  # warm up
        computed = 0
        started = time.perf_counter()
        for i in range(0, len(requests), self.batch_size):
            batch = requests[i : i + self.batch_size]
            new_tokens = max(r.max_tokens for r in batch)
            produced = self._generate(batch, new_tokens, pad, workload.temperature)
            if produced != new_tokens:
                raise RuntimeError(f"hf-static: asked for {new_tokens} new tokens, got {produced}")
            computed += new_tokens * len(batch)
        seconds = time.perf_counter() - started
        return EngineRun(
            engine=f"{self.name} (batch {self.batch_size})",
            seconds=seconds,
            num_prompt_tokens=workload.num_prompt_tokens,
            num_output_tokens=workload.num_output_tokens,
            num_computed_tokens=computed,
            note=f"computed {computed} output tokens for {workload.num_output_tokens} asked",
        )

    @torch.inference_mode()
    def _generate(self, batch, new_tokens: int, pad: int, temperature: float) -> int:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - n :] = 1
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
            **_sampling_kwargs(temperature),
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
