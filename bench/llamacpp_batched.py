"""llama.cpp running many sequences at once, as its own server does, through llama-cpp-python's C API.

llama-cpp-python's `Llama` runs one sequence; llama.cpp itself batches: one `llama_decode` per
step over a batch that holds each running sequence's next token and the prompts of sequences just
admitted, all sharing one KV cache (`n_seq_max` sequences). `LlamaCppBatchedEngine` drives that
loop for a workload with `parallel` slots (continuous batching: a finished sequence's slot takes
the next request at the next step), sampling with llama.cpp's own sampler chain (temperature,
then a seeded draw) in C. Imported only when llama-cpp-python is installed.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from cadenza.bench.engines import EngineRun
from cadenza.bench.workload import Workload

# Tokens one `llama_decode` call takes (llama.cpp splits them into micro-batches of `_UBATCH`).
_BATCH = 2048
_UBATCH = 512


class LlamaCppError(RuntimeError):
    """llama.cpp refused a model, a context or a batch; the message names the call."""


@dataclass(slots=True)
class _Slot:
    request: int  # index of the request it runs
    remaining: int  # tokens still to sample
    position: int  # position of the next token fed in
    last: int = 0  # the token sampled last, fed in at the next step
    logits_row: int = 0  # this step's batch row whose logits sample the next token


class LlamaCppBatchedEngine:
    name = "llama.cpp"

    def __init__(self, gguf_path: Path, *, num_threads: int | None, max_len: int, parallel: int = 32, seed: int = 0) -> None:
        import llama_cpp as lc
        from llama_cpp import _logger

        _logger.set_verbose(False)  # llama.cpp's load log goes through llama-cpp-python's logger
        self.lc, self.path, self.parallel, self.max_len = lc, gguf_path, parallel, max_len
        threads = num_threads or os.cpu_count() or 1
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(str(gguf_path).encode(), lc.llama_model_default_params())
        if not self.model:
            raise LlamaCppError(f"llama_model_load_from_file failed for {gguf_path}")
        params = lc.llama_context_default_params()
        # One shared cache with room for every slot's longest sequence (llama.cpp wants a multiple of 256 per slot).
        params.n_ctx = parallel * -(-max_len // 256) * 256
        params.n_batch, params.n_ubatch = _BATCH, _UBATCH
        params.n_seq_max = parallel
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise LlamaCppError("llama_init_from_model failed")
        self.memory = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(_BATCH, 0, 1)
        self.seed = seed
        self.sampler = None

    def close(self) -> None:
        """Free llama.cpp's sampler, batch, context and model (once; later calls do nothing)."""
        lc = self.lc
        if self.sampler is not None:
            lc.llama_sampler_free(self.sampler)
            self.sampler = None
        if self.ctx is not None:
            lc.llama_batch_free(self.batch)
            lc.llama_free(self.ctx)
            lc.llama_model_free(self.model)
            self.ctx = None

    def run(self, workload: Workload) -> EngineRun:
        self.generate([list(range(100, 116))], [4], workload.temperature)  # warm up
        started = time.perf_counter()
        outputs = self.generate([r.prompt_token_ids for r in workload.requests], [r.max_tokens for r in workload.requests],
                                workload.temperature)
        seconds = time.perf_counter() - started
        produced = sum(map(len, outputs))
        return EngineRun(
            engine=f"{self.name} (bf16, {self.parallel} parallel)",
            seconds=seconds,
            num_prompt_tokens=workload.num_prompt_tokens,
            num_output_tokens=produced,
            num_computed_tokens=produced,
            note=f"llama_decode over up to {self.parallel} sequences a step, {self.path.name}",
        )

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float) -> list[list[int]]:
        """Run every prompt to its `max_tokens` (EOS ignored); returns each one's sampled tokens."""
        lc = self.lc
        for prompt, n in zip(prompts, max_tokens):
            if len(prompt) + n > self.max_len or len(prompt) > _BATCH - self.parallel:
                raise ValueError(f"a request of {len(prompt)} + {n} tokens does not fit llama.cpp's context or batch")
        self._reset_sampler(temperature)
        lc.llama_memory_clear(self.memory, True)
        pending = deque(enumerate(zip(prompts, max_tokens)))
        outputs: list[list[int]] = [[] for _ in prompts]
        free = list(range(self.parallel - 1, -1, -1))
        running: dict[int, _Slot] = {}
        while pending or running:
            rows = 0
            for seq, slot in running.items():  # each running sequence's last token
                slot.logits_row = rows
                rows = self._add(rows, slot.last, slot.position, seq, True)
                slot.position += 1
            while pending and free and rows + len(pending[0][1][0]) <= _BATCH:  # admit whole prompts
                index, (prompt, n) = pending.popleft()
                seq = free.pop()
                for i, token in enumerate(prompt):
                    rows = self._add(rows, token, i, seq, i == len(prompt) - 1)
                running[seq] = _Slot(index, remaining=n, position=len(prompt), logits_row=rows - 1)
            self.batch.n_tokens = rows
            code = lc.llama_decode(self.ctx, self.batch)
            if code != 0:
                raise LlamaCppError(f"llama_decode returned {code}")
            for seq in list(running):
                slot = running[seq]
                slot.last = lc.llama_sampler_sample(self.sampler, self.ctx, slot.logits_row)
                outputs[slot.request].append(slot.last)
                slot.remaining -= 1
                if slot.remaining == 0:
                    lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
                    del running[seq]
                    free.append(seq)
        return outputs

    def time_decode_batch(self, prompts: list[list[int]], num_tokens: int, temperature: float) -> float:
        """Seconds per decode step of `len(prompts)` sequences together, after their prefill."""
        # Decode steps alone: the whole run minus a run that only prefills (one token each).
        whole_started = time.perf_counter()
        self.generate(prompts, [num_tokens + 1] * len(prompts), temperature)
        whole = time.perf_counter() - whole_started
        started = time.perf_counter()
        self.generate(prompts, [1] * len(prompts), temperature)
        prefill = time.perf_counter() - started
        return max(whole - prefill, 1e-9) / num_tokens

    def _add(self, row: int, token: int, position: int, seq: int, logits: bool) -> int:
        b = self.batch
        b.token[row] = token
        b.pos[row] = position
        b.n_seq_id[row] = 1
        b.seq_id[row][0] = seq
        b.logits[row] = logits
        return row + 1

    def _reset_sampler(self, temperature: float) -> None:
        lc = self.lc
        if self.sampler is not None:
            lc.llama_sampler_free(self.sampler)
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if temperature > 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(temperature))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(self.seed))
        else:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        self.sampler = chain
