"""The runner core: turns one step's scheduled chunks into tensors, runs the model, samples.

It makes no policy decisions: what to run, which blocks to use and when to stop are the
scheduler's and cache manager's business. Synchronous; the runner actor calls it off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import torch

from cadenza.attention_backends.base import AttentionBackend, AttentionMetadata
from cadenza.models.llama import LlamaForCausalLM
from cadenza.samplers.base import SamplerOutput, SamplingBatch, SamplingError
from cadenza.sampling_params import SamplingParams
from cadenza.step import PENDING_TOKEN, ScheduledChunk

__all__ = ["PENDING_TOKEN", "ModelRunner", "ScheduledChunk", "StepResult"]


@dataclass(slots=True)
class _RequestRecord:
    """What sampling reads of one request, kept here from its first sampled chunk until the
    scheduler reports it gone: the prompt, the tokens sampled so far, its seeded generator."""

    prompt_token_ids: Sequence[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    """Sampled tokens for the chunks with `sample` set, in their order; logits when asked for.

    `failed` lists (request_id, message) for requests a failing sampler plugin took down; they
    are not in `request_ids`.
    """

    request_ids: list[str]
    sampled: SamplerOutput | None
    logits: torch.Tensor | None = None
    failed: list[tuple[str, str]] = field(default_factory=list)


class _PackingBuffers:
    """Host arrays reused every step, grown when a step needs more; tensors are views of them."""

    def __init__(self) -> None:
        self.tokens = np.empty(0, dtype=np.int64)
        self.tables = np.empty((0, 0), dtype=np.int64)

    def token_array(self, n: int) -> np.ndarray:
        if self.tokens.shape[0] < n:
            self.tokens = np.empty(max(n, 2 * self.tokens.shape[0]), dtype=np.int64)
        return self.tokens[:n]

    def table_array(self, rows: int, cols: int) -> np.ndarray:
        have_rows, have_cols = self.tables.shape
        if have_rows < rows or have_cols < cols:
            self.tables = np.empty((max(rows, have_rows), max(cols, have_cols)), dtype=np.int64)
        table = self.tables[:rows, :cols]
        table.fill(0)
        return table


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        sampling_pipeline,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.sampling_pipeline = sampling_pipeline
        self.block_size = block_size
        self.device = device
        self._buffers = _PackingBuffers()
        self._last_sampled: dict[str, int] = {}  # what the previous step sampled, by request
        self._requests: dict[str, _RequestRecord] = {}  # by request id, until finish_requests

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk], return_logits: bool = False) -> StepResult:
        if not chunks:
            raise ValueError("a step needs at least one chunk")
        chunks, unresolved = self._resolve_pending(chunks)
        failed = [(c.request_id, "the step that was to produce its input token failed") for c in unresolved]
        if not chunks:
            self._last_sampled = {}
            return StepResult([], None, failed=failed)
        result = self._run(chunks, return_logits)
        result.failed[:0] = failed
        self._last_sampled = {}
        if result.sampled is not None:
            self._last_sampled = dict(zip(result.request_ids, result.sampled.token_ids.tolist()))
            for request_id, token in self._last_sampled.items():
                self._requests[request_id].output_token_ids.append(token)
        return result

    def _resolve_pending(self, chunks: Sequence[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
        resolved, unresolved = [], []
        for chunk in chunks:
            if PENDING_TOKEN not in chunk.token_ids:
                resolved.append(chunk)
                continue
            token = self._last_sampled.get(chunk.request_id)
            if token is None:
                unresolved.append(chunk)
                continue
            ids = [token if t == PENDING_TOKEN else t for t in chunk.token_ids]
            resolved.append(replace(chunk, token_ids=ids))
        return resolved, unresolved

    def _run(self, chunks: Sequence[ScheduledChunk], return_logits: bool) -> StepResult:
        input_ids, positions, meta = self._prepare(chunks)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        sampling_rows = [i for i, c in enumerate(chunks) if c.sample]
        request_ids = [chunks[i].request_id for i in sampling_rows]
        if not sampling_rows:
            return StepResult(request_ids, None)
        last_hidden = hidden[(meta.query_start_loc[1:] - 1)[sampling_rows]]
        logits = self.model.compute_logits(last_hidden)
        try:
            sampled = self.sampling_pipeline(logits.clone() if return_logits else logits, self._batch(chunks, sampling_rows))
        except SamplingError as exc:
            return self._resample_without(exc, chunks, sampling_rows, last_hidden)
        return StepResult(request_ids, sampled, logits if return_logits else None)

    def finish_requests(self, request_ids: Sequence[str]) -> None:
        """The scheduler reports these requests gone: their records and the sampling plugins'
        state go."""
        if request_ids:
            for request_id in request_ids:
                self._requests.pop(request_id, None)
            self.sampling_pipeline.finish_requests(request_ids)

    def _record(self, chunk: ScheduledChunk) -> _RequestRecord:
        """The request's record, made the first time it samples (its generator seeded then, as
        once per request: a preempted request recomputes, and goes on drawing from the same
        stream); tokens beyond `chunk.num_output_tokens` were sampled before a preemption and
        dropped by the scheduler, so they go here too."""
        record = self._requests.get(chunk.request_id)
        if record is None:
            seed = chunk.params.seed if chunk.params is not None else None
            generator = None if seed is None else torch.Generator().manual_seed(seed)
            record = self._requests[chunk.request_id] = _RequestRecord(chunk.prompt_token_ids, generator=generator)
        elif chunk.num_output_tokens is not None and len(record.output_token_ids) > chunk.num_output_tokens:
            del record.output_token_ids[chunk.num_output_tokens :]
        return record

    def _batch(self, chunks: Sequence[ScheduledChunk], rows: list[int]) -> SamplingBatch:
        records, failed = [], {}
        for row, i in enumerate(rows):
            try:
                records.append(self._record(chunks[i]))
            except Exception as exc:  # a seed torch refuses: that request fails, the step goes on
                failed[row] = f"the runner could not set up sampling for this request: {exc!r}"
        if failed:
            raise SamplingError("the runner", sorted(failed), "request setup failed", failed)
        return SamplingBatch(
            params=[chunks[i].params or SamplingParams() for i in rows],
            prompt_token_ids=[r.prompt_token_ids for r in records],
            output_token_ids=[r.output_token_ids for r in records],
            generators=[r.generator for r in records],
            request_ids=[chunks[i].request_id for i in rows],
        )

    def _resample_without(self, exc: SamplingError, chunks, sampling_rows: list[int], last_hidden) -> StepResult:
        """Fail the rows a plugin took down; sample the rest again from fresh logits.

        The processors may have half-edited the logits in place, so the survivors' logits are
        recomputed from the hidden states rather than reused. Another plugin may then fail other
        rows (it had not run yet): each round drops the rows blamed, so innocent rows survive
        any number of failing plugins, and the loop ends because every round drops a row.
        """
        failed: list[tuple[str, str]] = []
        alive = list(range(len(sampling_rows)))  # indices into sampling_rows still to sample
        while True:
            blamed = {r for r in exc.rows if 0 <= r < len(alive)}
            if not blamed:  # a plugin blamed no row it was given: nobody can be trusted
                blamed = set(range(len(alive)))
            failed += [(chunks[sampling_rows[alive[r]]].request_id, exc.message_for(r)) for r in sorted(blamed)]
            alive = [a for r, a in enumerate(alive) if r not in blamed]
            if not alive:
                return StepResult([], None, failed=failed)
            rows = [sampling_rows[a] for a in alive]
            logits = self.model.compute_logits(last_hidden[alive])
            try:
                sampled = self.sampling_pipeline(logits, self._batch(chunks, rows))
            except SamplingError as again:
                exc = again
                continue
            return StepResult([chunks[i].request_id for i in rows], sampled, failed=failed)

    def _prepare(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        block_size = self.block_size
        num_seqs = len(chunks)
        query_lens = [len(c.token_ids) for c in chunks]
        starts = [c.start_position for c in chunks]
        seq_lens = [s + q for s, q in zip(starts, query_lens)]
        for c, seq_len in zip(chunks, seq_lens):
            if len(c.block_table) * block_size < seq_len:
                raise ValueError(
                    f"request {c.request_id}: block table covers {len(c.block_table) * block_size} tokens, "
                    f"step needs {seq_len}"
                )
        num_tokens = sum(query_lens)
        tables = self._buffers.table_array(num_seqs, max(len(c.block_table) for c in chunks))
        ids = self._buffers.token_array(num_tokens)
        offset = 0
        for row, chunk in enumerate(chunks):
            tables[row, : len(chunk.block_table)] = chunk.block_table
            ids[offset : offset + query_lens[row]] = chunk.token_ids
            offset += query_lens[row]
        query_lens_np = np.asarray(query_lens, dtype=np.int64)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens_np, out=query_start_loc[1:])
        seq_index = np.repeat(np.arange(num_seqs), query_lens_np)
        context_lens = np.asarray(starts, dtype=np.int64)
        positions = context_lens[seq_index] + np.arange(num_tokens) - query_start_loc[seq_index]
        slot_mapping = tables[seq_index, positions // block_size] * block_size + positions % block_size
        device = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc).to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            context_lens=torch.from_numpy(context_lens).to(device),
            block_tables=torch.from_numpy(tables).to(device),
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return torch.from_numpy(ids).to(device), torch.from_numpy(positions).to(device), meta
