"""`draft`: a smaller model, in the same process and sharing the tokenizer, guesses greedily.

The draft runs on a model runner of its own over a small paged cache, both built by the runtime
(`ProposerContext.load_draft`): each request it drafts for holds one of `num_slots` slots, a fixed
run of blocks long enough for `max_model_len` tokens, so the draft's cache is contiguous per request and needs no manager. Per call it finds the longest
common prefix of the tokens it has cached for the request and the request's tokens now (a
rejected guess, or a preemption, cuts it back), runs the rest as one chunk, then decodes
`num_tokens - 1` more steps, every request in one batch, taking the argmax each time. A request
that finds no free slot, or would pass the draft's context, gets no guess.

With one model at hand the draft may be the same GGUF at a cheaper precision (`quantization:
auto`, its native Q4 blocks) drafting for a float target (`model.quantization: none`).
"""

from __future__ import annotations

from typing import Literal, Sequence

from pydantic import BaseModel, Field

from cadenza.speculative.base import ProposalRequest, Proposer, ProposerContext


class DraftOptions(BaseModel):
    """`plugin_options.draft`."""

    model: str | None = Field(None, description="The draft model (HF directory or .gguf); null: the target's own weights.")
    quantization: Literal["auto", "none", "int8"] = Field("auto", description="As model.quantization, for the draft.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="As model.dtype, for the draft.")
    num_slots: int = Field(4, ge=1, le=256, description="Requests drafted for at once (each holds a cache slot).")
    max_model_len: int = Field(2048, ge=16, description="Longest sequence the draft keeps a cache for.")
    block_size: int = Field(16, ge=1, le=256, description="Block size of the draft's cache.")


class DraftVocabularyError(ValueError):
    """The draft model's vocabulary differs from the target's: guesses would be other tokens."""


class DraftModelProposer(Proposer):
    """Greedy drafting with a second model."""

    name = "draft"
    options_model = DraftOptions

    def __init__(self, context: ProposerContext, options: DraftOptions | None = None) -> None:
        super().__init__(context, options)
        from cadenza.sampling_params import SamplingParams

        opts = self.options
        if context.load_draft is None:
            raise ValueError("speculative method 'draft' needs a runtime that builds draft models (ProposerContext.load_draft)")
        path = opts.model if opts.model is not None else context.model_path
        draft = context.load_draft(path=path, dtype=opts.dtype, quantization=opts.quantization,
                                   max_model_len=min(opts.max_model_len, context.max_model_len),
                                   num_slots=opts.num_slots, block_size=opts.block_size,
                                   eos_token_ids=context.eos_token_ids)  # fmt: skip
        if draft.vocab_size != context.vocab_size:
            raise DraftVocabularyError(
                f"draft model {draft.source} has a vocabulary of {draft.vocab_size} tokens, the target {context.vocab_size}"
            )
        self.max_len = draft.max_model_len
        self.blocks_per_slot = draft.blocks_per_slot
        self.runner = draft.runner
        self.greedy = SamplingParams(temperature=0)
        self._slots: dict[str, int] = {}  # request id -> slot
        self._free = list(range(opts.num_slots))
        self._cached: dict[str, list[int]] = {}  # tokens whose K/V the draft holds, per request

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Sequence[int]]:
        from cadenza.step import ScheduledChunk

        guesses: dict[str, list[int]] = {}
        chunks, ends = [], {}
        for request in requests:
            tokens = list(request.token_ids)
            if len(tokens) + request.num_tokens > self.max_len or not self._take_slot(request.request_id):
                continue
            cached = self._cached.setdefault(request.request_id, [])
            keep = _common_prefix(cached, tokens, limit=len(tokens) - 1)  # at least one token to run
            del cached[keep:]
            cached.extend(tokens[keep:])
            chunks.append(ScheduledChunk(request.request_id, tokens[keep:], keep, self._table(request.request_id), True, self.greedy))
            ends[request.request_id] = request.num_tokens
            guesses[request.request_id] = []
        while chunks:
            result = self.runner.execute(chunks)
            sampled = dict(zip(result.request_ids, result.sampled.token_ids.tolist())) if result.sampled is not None else {}
            chunks = []
            for request_id, token in sampled.items():
                guess = guesses[request_id]
                guess.append(token)
                if len(guess) < ends[request_id]:
                    cached = self._cached[request_id]
                    chunks.append(ScheduledChunk(request_id, [token], len(cached), self._table(request_id), True, self.greedy))
                    cached.append(token)
        return [guesses.get(r.request_id, []) for r in requests]

    def on_request_finished(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        self._cached.pop(request_id, None)
        self.runner.finish_requests([request_id])

    def on_request_reset(self, request_id: str) -> None:
        pass  # the common-prefix check already drops what no longer matches

    @property
    def num_requests(self) -> int:
        return len(self._slots)

    def _take_slot(self, request_id: str) -> bool:
        if request_id in self._slots:
            return True
        if not self._free:
            return False
        self._slots[request_id] = self._free.pop()
        return True

    def _table(self, request_id: str) -> list[int]:
        start = self._slots[request_id] * self.blocks_per_slot
        return list(range(start, start + self.blocks_per_slot))


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
