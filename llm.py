"""`LLM`: offline, synchronous generation for many prompts at once.

    from cadenza import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2 model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from cadenza.block_pool import BlockPool
from cadenza.config import CadenzaConfig, load_config
from cadenza.model_runner import ScheduledChunk
from cadenza.outputs import RequestOutput, TokenLogprob
from cadenza.prompts import Prompt, PromptError, is_single_prompt, tokenize_prompt
from cadenza.runtime import Runtime, build_runtime
from cadenza.sampling_params import SamplingParams

# Short keyword names accepted by LLM(...), mapped to their config paths.
_OVERRIDES = {
    "dtype": "model.dtype",
    "device": "model.device",
    "max_model_len": "model.max_model_len",
    "num_threads": "model.num_threads",
    "seed": "model.seed",
    "block_size": "cache.block_size",
    "num_blocks": "cache.num_blocks",
    "memory_budget": "cache.memory_budget",
    "eviction_policy": "cache.eviction_policy",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "chunk_size": "scheduler.chunk_size",
    "attention_backend": "attention_backend",
    "sampler": "sampling.sampler",
    "logits_processors": "sampling.logits_processors",
    "plugins": "plugins",
}


def config_overrides(model: str | Path | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """LLM keyword arguments as dotted config overrides; unknown names raise TypeError."""
    dotted: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in _OVERRIDES:
            dotted[_OVERRIDES[key]] = value
        elif "." in key:
            dotted[key] = value
        else:
            known = ", ".join(sorted(_OVERRIDES))
            raise TypeError(f"LLM() got an unexpected keyword argument {key!r}; known: {known}, or a dotted config path")
    if model is not None:
        dotted["model.path"] = str(model)
    return dotted


@dataclass
class _Sequence:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    finish_reason: str | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class LLM:
    def __init__(self, model: str | Path | None = None, *, config: CadenzaConfig | str | Path | None = None, **overrides: Any) -> None:
        dotted = config_overrides(model, overrides)
        if isinstance(config, CadenzaConfig):
            # A config object is already complete: keyword overrides apply on top, nothing else.
            self.config = load_config(None, overrides={**config.model_dump(mode="json"), **dotted}, env={})
        else:
            self.config = load_config(config, overrides=dotted)
        self.runtime: Runtime = build_runtime(self.config)
        self.tokenizer = self.runtime.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        batch = [prompts] if is_single_prompt(prompts) else list(prompts)
        if params is None:
            params = SamplingParams()
        per_prompt = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(batch):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(batch)} prompts")
        sequences = [self._make_sequence(p, sp) for p, sp in zip(batch, per_prompt)]
        _OfflineLoop(self.runtime).run(sequences)
        return [self._output(s) for s in sequences]

    def _make_sequence(self, prompt: Prompt, params: SamplingParams) -> _Sequence:
        arch = self.runtime.loaded.arch
        text, ids = tokenize_prompt(prompt, self.tokenizer, arch.vocab_size)
        limit = self.runtime.max_model_len
        if len(ids) >= limit:
            raise PromptError(f"prompt has {len(ids)} tokens; max_model_len is {limit}")
        room = limit - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        return _Sequence(
            request_id=str(next(self._ids)),
            prompt=text,
            prompt_ids=ids,
            params=params,
            max_tokens=max_tokens,
            generator=generator,
            logprobs=[] if params.logprobs is not None else None,
        )

    def _output(self, seq: _Sequence) -> RequestOutput:
        ids = seq.output_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
        finish = seq.finish_reason
        if seq.params.stop:
            text, hit = _truncate_at_stop(text, seq.params)
            finish = "stop" if hit else finish
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_ids, text, ids, finish, seq.logprobs)


def _truncate_at_stop(text: str, params: SamplingParams) -> tuple[str, bool]:
    hits = [(text.find(s), s) for s in params.stop if s in text]
    if not hits:
        return text, False
    index, stop = min(hits)
    return text[: index + (len(stop) if params.include_stop_str_in_output else 0)], True


class _OfflineLoop:
    """Runs sequences to completion: chunked prefills and decodes mixed under a token budget."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.runner = runtime.runner
        self.block_size = runtime.block_size
        self.pool = BlockPool(runtime.num_blocks)
        sched = runtime.config.scheduler
        self.max_seqs, self.budget, self.chunk = sched.max_num_seqs, sched.max_num_batched_tokens, sched.chunk_size
        self.eos_ids = set(runtime.tokenizer.eos_token_ids)

    def run(self, sequences: list[_Sequence]) -> None:
        waiting = list(sequences)
        running: list[_Sequence] = []
        while waiting or running:
            chunks = self._schedule(waiting, running)
            result = self.runner.execute(chunks)
            self._postprocess(chunks, result, running)

    def _blocks_needed(self, seq: _Sequence, new_tokens: int) -> int:
        return max(0, -(-(seq.num_computed + new_tokens) // self.block_size) - len(seq.blocks))

    def _schedule(self, waiting: list[_Sequence], running: list[_Sequence]) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        budget = self.budget
        for seq in list(running):
            if seq not in running:
                continue  # preempted below to make room for an earlier sequence
            new = min(len(seq.all_ids) - seq.num_computed, self.chunk, budget)
            if new <= 0:
                continue
            while not self.pool.can_allocate(self._blocks_needed(seq, new)):
                victim = running[-1]
                self._preempt(victim, running, waiting)
                if victim is seq:
                    break
            if seq not in running:
                continue
            chunks.append(self._chunk(seq, new))
            budget -= new
        while waiting and len(running) < self.max_seqs and budget > 0:
            seq = waiting[0]
            new = min(len(seq.all_ids) - seq.num_computed, self.chunk, budget)
            if not self.pool.can_allocate(self._blocks_needed(seq, new)):
                break
            waiting.pop(0)
            running.append(seq)
            chunks.append(self._chunk(seq, new))
            budget -= new
        if not chunks:
            raise RuntimeError("the KV cache is too small for a single sequence; raise cache.num_blocks")
        return chunks

    def _chunk(self, seq: _Sequence, new: int) -> ScheduledChunk:
        seq.blocks += self.pool.allocate(self._blocks_needed(seq, new))
        start = seq.num_computed
        ids = seq.all_ids
        seq.num_computed += new
        return ScheduledChunk(
            request_id=seq.request_id,
            token_ids=ids[start : start + new],
            start_position=start,
            block_table=list(seq.blocks),
            sample=seq.num_computed == len(ids),
            params=seq.params,
            prompt_token_ids=seq.prompt_ids,
            output_token_ids=seq.output_ids,
            generator=seq.generator,
        )

    def _preempt(self, seq: _Sequence, running: list[_Sequence], waiting: list[_Sequence]) -> None:
        # Recompute: drop its cache; it re-prefills prompt + output so far and continues unchanged.
        running.remove(seq)
        self.pool.free(seq.blocks)
        seq.blocks, seq.num_computed = [], 0
        waiting.insert(0, seq)

    def _postprocess(self, chunks, result, running: list[_Sequence]) -> None:
        if result.sampled is None:
            return
        by_id = {s.request_id: s for s in running}
        tokens = result.sampled.token_ids.tolist()
        for row, (request_id, token) in enumerate(zip(result.request_ids, tokens)):
            seq = by_id[request_id]
            seq.output_ids.append(token)
            if seq.logprobs is not None:
                seq.logprobs.append(_logprob_at(result.sampled, row, token, seq.params.logprobs))
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.finish_reason is not None:
                running.remove(seq)
                self.pool.free(seq.blocks)
                seq.blocks = []

    def _finish_reason(self, seq: _Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids:
            return "stop"
        if token in self.eos_ids and not params.ignore_eos:
            return "stop"
        if len(seq.output_ids) >= seq.max_tokens:
            return "length"
        if params.stop and any(s in self.runtime.tokenizer.decode(seq.output_ids) for s in params.stop):
            return "stop"
        return None


def _logprob_at(sampled, row: int, token: int, top_n: int) -> TokenLogprob:
    top = ()
    if sampled.top_logprobs is not None and top_n:
        ids, values = sampled.top_logprobs
        top = tuple(zip(ids[row, :top_n].tolist(), values[row, :top_n].tolist()))
    return TokenLogprob(token, float(sampled.logprobs[row]), top)
