"""The `structured_output` logits processor: each row may only emit what its grammar allows.

A request joins through its `SamplingParams.structured_outputs` (the processor's `request_field`).
Per request it keeps an llguidance matcher and how many of the request's output tokens the matcher
has consumed. Each step, for the rows that use it:

1. **Catch up.** The matcher consumes the row's output tokens it has not seen: normally the one
   token the previous step sampled. The runner's record of a request's tokens is the truth: under
   async scheduling it already holds the token of the step before (the runner fills in
   `PENDING_TOKEN` from it), and after a preemption it has dropped the tokens sampled in flight,
   so a record shorter than what the matcher consumed means roll back that many.
2. **Mask.** llguidance fills one bitmask row per request (32 tokens per int32, in parallel
   threads that drop the GIL), and one batched op sets every disallowed logit to -inf. Ids past
   the tokenizer's vocabulary (a model's padded rows) are never allowed.

When the grammar is complete only EOS is allowed, so the request ends there. A matcher that
rejects a token (another plugin forced one the grammar refused) fails its own request only.
Grammars compile at the ingress (`prepare_request`, in a worker thread; the first one also builds
llguidance's view of the vocabulary); `on_request_added` then
copies the cached matcher, so the step a request first samples in never waits on a compile
(unless the cache dropped it in between: then that one step compiles it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from cadenza.samplers.base import LogitsProcessor, SamplingBatch, SamplingContext, SamplingError
from cadenza.sampling_params import StructuredOutputs

_NEG_INF = float("-inf")


@dataclass(slots=True)
class _RowState:
    """One request's matcher and how many of its output tokens it has consumed.

    `eos_after_stop` counts EOS tokens at the end of the output that the matcher never saw: once
    a grammar has stopped, llguidance refuses any token, but under async scheduling a request may
    sample once more (EOS, the only token allowed) before the scheduler has seen it end.
    """

    matcher: object  # llguidance.LLMatcher
    eos_token_ids: frozenset[int]
    consumed: int = 0
    eos_after_stop: int = 0

    def catch_up(self, output: Sequence[int]) -> str | None:
        """Bring the matcher to the end of `output`; the problem, if it cannot."""
        matcher, have = self.matcher, len(output)
        if have < self.consumed:  # a preemption dropped tokens sampled in flight
            drop = self.consumed - have
            unfed = min(drop, self.eos_after_stop)
            self.eos_after_stop -= unfed
            if drop > unfed and not matcher.rollback(drop - unfed):
                return f"could not roll back {drop - unfed} tokens: {matcher.get_error()}"
            self.consumed = have
        for token in output[self.consumed : have]:
            if matcher.is_stopped() and not matcher.is_error() and token in self.eos_token_ids:
                self.eos_after_stop += 1
            elif not matcher.consume_token(token):
                return f"the grammar does not allow the sampled token {token}: {matcher.get_error() or 'rejected'}"
            self.consumed += 1
        if matcher.is_error():
            return matcher.get_error()
        return None


class StructuredOutputProcessor(LogitsProcessor):
    """Masks each constrained row's logits to the tokens its grammar allows next."""

    name = "structured_output"
    request_field = "structured_outputs"

    def __init__(self, context: SamplingContext, options=None) -> None:
        super().__init__(context, options)
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._executor = None
        self._states: dict[str, _RowState] = {}
        self._bitmask = torch.empty((0, 0), dtype=torch.int32)

    @property
    def compiler(self):
        """The engine's grammar cache, with llguidance's view of the vocabulary: built by the first
        request that needs it (at the ingress, in `prepare_request`), not at start-up: it takes
        ~0.35 s and ~24 MiB (the default model's 49k tokens), which an engine serving no
        structured output never pays."""
        with self._compiler_lock:  # the ingress's worker threads and the compute thread
            if self._compiler is None:
                from cadenza.samplers.grammars import GrammarCompiler, build_lltokenizer

                context = self.context
                if context.tokenizer is None:
                    raise RuntimeError("structured outputs need the model's tokenizer (SamplingContext.tokenizer)")
                tokenizer = build_lltokenizer(context.tokenizer, context.vocab_size, context.eos_token_ids)
                self._compiler = GrammarCompiler(tokenizer)
            return self._compiler

    def prepare_request(self, params: StructuredOutputs) -> None:
        """Compile (or find cached) the request's grammar; `GrammarError` names what is wrong."""
        self.compiler.compile(params)

    def on_request_added(self, request_id: str, params: StructuredOutputs) -> None:
        self._states[request_id] = _RowState(self.compiler.matcher(params), frozenset(self.context.eos_token_ids))

    def on_request_finished(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        """Requests holding a matcher (zero once every constrained request has left)."""
        return len(self._states)

    def is_active(self, batch: SamplingBatch) -> bool:
        states = self._states
        return bool(states) and any(r in states for r in batch.request_ids)

    def rows_using(self, batch: SamplingBatch) -> list[int]:
        states = self._states
        return [i for i, r in enumerate(batch.request_ids) if r in states]

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = self.rows_using(batch)
        states = [self._states[batch.request_ids[i]] for i in rows]
        problems = {}
        for row, state in zip(rows, states):
            problem = state.catch_up(batch.output_token_ids[row])
            if problem is not None:
                problems[row] = f"structured output: {problem}"
        if problems:  # only these rows fail; the pipeline samples the others again
            raise SamplingError(f"logits processor {self.name!r}", sorted(problems), "grammar error", problems)
        bitmask = self._fill_bitmask([s.matcher for s in states], logits.shape[-1])
        apply_bitmask(logits, bitmask, rows)
        return logits

    def _fill_bitmask(self, matchers: list, vocab_size: int) -> torch.Tensor:
        """One bitmask row per matcher, filled by llguidance's thread pool (the GIL released)."""
        from llguidance import LLExecutor
        from llguidance.torch import fill_next_token_bitmask_par

        words = (vocab_size + 31) // 32
        if self._bitmask.shape[0] < len(matchers) or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty((max(len(matchers), 2 * self._bitmask.shape[0]), words), dtype=torch.int32)
        bitmask = self._bitmask[: len(matchers)]
        if self._executor is None:
            self._executor = LLExecutor()
        fill_next_token_bitmask_par(self._executor, [(m, k) for k, m in enumerate(matchers)], bitmask)
        return bitmask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] with bit j of word w for token 32*w + j -> bool [R, vocab_size] (allowed)."""
    if bitmask.is_cpu:
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab_size, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the disallowed logits of `rows` (row k of `bitmask` is `rows[k]`) to -inf, in place."""
    vocab = logits.shape[-1]
    allowed = unpack_bitmask(bitmask, vocab).to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:  # every row constrained (rows are in batch order)
        logits.masked_fill_(~allowed, _NEG_INF)
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    constrained = logits.index_select(0, index).masked_fill_(~allowed, _NEG_INF)
    logits.index_copy_(0, index, constrained)
