"""`draft`: a smaller model, in the same process and sharing the tokenizer, guesses greedily.

The draft runs on a `ModelRunner` of its own over a small paged cache: each request it drafts for
holds one of `num_slots` slots, a fixed run of blocks long enough for `max_model_len` tokens, so
the draft's cache is contiguous per request and needs no manager. Per call it finds the longest
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
        import torch

        from cadenza.attention_backends.torch_sdpa import TorchSDPABackend
        from cadenza.runner.kv_cache import allocate_kv_caches
        from cadenza.runner.model_runner import ModelRunner
        from cadenza.models.loading import load_model
        from cadenza.samplers.base import SamplingContext
        from cadenza.samplers.default_sampler import DefaultSampler
        from cadenza.samplers.pipeline import SamplingPipeline
        from cadenza.sampling_params import SamplingParams

        opts = self.options
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        device = context.device or torch.device("cpu")
        path = opts.model if opts.model is not None else context.model_path
        loaded = load_model(path, dtype=dtypes.get(opts.dtype, torch.bfloat16), device=device,
                            max_model_len=min(opts.max_model_len, context.max_model_len),
                            cpu_kernels="auto", quantization=opts.quantization)  # fmt: skip
        arch = loaded.arch
        if arch.vocab_size != context.vocab_size:
            raise DraftVocabularyError(
                f"draft model {loaded.source} has a vocabulary of {arch.vocab_size} tokens, the target {context.vocab_size}"
            )
        self.max_len = loaded.max_model_len
        self.blocks_per_slot = -(-self.max_len // opts.block_size)
        caches = allocate_kv_caches(arch, opts.num_slots * self.blocks_per_slot, opts.block_size, loaded.compute_dtype, device)
        backend = TorchSDPABackend(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                                   scale=arch.head_dim**-0.5, block_size=opts.block_size,
                                   sliding_window=arch.sliding_window, device=device)  # fmt: skip
        if loaded.compute_dtype == torch.float32:
            backend.use_cpu_kernels(loaded.model.kernels)
        sampling = SamplingContext(vocab_size=arch.vocab_size, eos_token_ids=context.eos_token_ids, device=device)
        pipeline = SamplingPipeline(sampling, [], DefaultSampler(sampling))
        self.runner = ModelRunner(loaded.model, caches, backend, pipeline, opts.block_size, device)
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
