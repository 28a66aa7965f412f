"""The runner core: turns one step's scheduled chunks into tensors, runs the model, samples.

It makes no policy decisions: what to run, which blocks to use and when to stop are the
scheduler's and cache manager's business. Synchronous; the runner actor calls it off the event loop.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from cadenza.attention_backends.base import AttentionBackend
from cadenza.models.llama import LlamaForCausalLM
from cadenza.outputs import TokenLogprob
from cadenza.runner.step_inputs import StepInputs, StepPacker
from cadenza.samplers.base import SamplerOutput, SamplingBatch, SamplingError
from cadenza.sampling_params import SamplingParams
from cadenza.speculative.speculator import Speculator
from cadenza.step import PENDING_TOKEN, Pooled, PromptLogprobs, ScheduledChunk, Speculation

__all__ = ["PENDING_TOKEN", "ModelRunner", "ScheduledChunk", "StepResult"]

# Prompt logprobs take the logits of this many rows at a time (a 49,152-token vocabulary: 100 MB
# in float32, and as much again for their log-softmax), so a step's memory stays bounded however
# many prompt rows it has.
PROMPT_LOGPROB_ROWS = 512


@dataclass(slots=True)
class _RequestRecord:
    """What sampling reads of one request, kept here from its first sampled chunk until the
    scheduler reports it gone: the prompt, the tokens sampled so far, its seeded generator; for an
    embedding request with mean pooling, the running sum of its rows' hidden states so far."""

    prompt_token_ids: Sequence[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    pooled_sum: torch.Tensor | None = None  # float32
    pooled_rows: int = 0


@dataclass(frozen=True, slots=True)
class StepResult:
    """Sampled tokens for the chunks with `sample` set, in their order; logits when asked for.

    `failed` lists (request_id, message) for requests a failing sampler plugin took down; they
    are not in `request_ids`. `accepted[request_id]`: a speculating request's verified guesses,
    which come before its sampled token; `speculated`: what each speculating request's guesses did;
    `prompt_logprobs`: what the step's prompt chunks that asked for them computed; `pooled`: the
    vectors of the embedding requests whose last chunk ran.
    """

    request_ids: list[str]
    sampled: SamplerOutput | None
    logits: torch.Tensor | None = None
    failed: list[tuple[str, str]] = field(default_factory=list)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    speculated: list[Speculation] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    pooled: list[Pooled] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        sampling_pipeline,
        block_size: int,
        device: torch.device,
        speculator: Speculator | None = None,
    ) -> None:
        self.model = model
        self.speculator = speculator
        self._methods: dict[str, str] = {}  # this step's speculating requests -> their proposer
        self.kv_caches = kv_caches
        self.backend = backend
        self.sampling_pipeline = sampling_pipeline
        self.block_size = block_size
        self.device = device
        self._packer = StepPacker(device, block_size)
        self.graphs = None  # a `DecodeGraphRunner` (runner/cuda_graphs.py) takes the decodes it can pad
        self._host_outputs = _HostOutputs(device)
        self._last_sampled: dict[str, int] = {}  # what the previous step sampled, by request
        self._requests: dict[str, _RequestRecord] = {}  # by request id, until finish_requests

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk], return_logits: bool = False) -> StepResult:
        if not chunks:
            raise ValueError("a step needs at least one chunk")
        started = time.perf_counter()
        chunks, unresolved = self._resolve_pending(chunks)
        failed = [(c.request_id, "the step that was to produce its input token failed") for c in unresolved]
        if not chunks:
            self._last_sampled = {}
            return StepResult([], None, failed=failed)
        guesses: dict[str, list[int]] = {}
        self._methods = {}
        if self.speculator is not None and any(c.num_speculative for c in chunks):
            chunks, guesses = self._add_guesses(chunks, failed)
            if not chunks:
                self._last_sampled = {}
                return StepResult([], None, failed=failed)
        try:
            result = self._run(chunks, return_logits, guesses)
        except BaseException:
            # Nothing was sampled: a next step's placeholders must not take the step before's tokens.
            self._last_sampled = {}
            raise
        result.failed[:0] = failed
        if result.sampled is not None:
            result = replace(result, sampled=self._host_outputs.fetch(result.sampled))
        if len(self._methods) > len(guesses):  # asked, none verified: the scheduler's policy counts those too
            sampled_ids, sized = set(result.request_ids), self.speculator.sized
            result.speculated.extend(
                Speculation(r, m, 0, 0, r in sized) for r, m in self._methods.items() if r not in guesses and r in sampled_ids
            )
        if self.speculator is not None:
            self.speculator.learn(result.speculated)
            self.speculator.observe_step(sum(len(c.token_ids) for c in chunks), time.perf_counter() - started)
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

    def _run(self, chunks: Sequence[ScheduledChunk], return_logits: bool, guesses: dict[str, list[int]]) -> StepResult:
        sampling_rows = [i for i, c in enumerate(chunks) if c.sample]
        ends = list(itertools.accumulate(len(c.token_ids) for c in chunks))  # one past each chunk's last row
        counts = [len(guesses.get(chunks[i].request_id, ())) for i in sampling_rows]
        # A speculating chunk samples first where its guesses start, the position before them;
        # then every guessed position, in the same product (rows are independent in the head's
        # kernel, so each row's logits are what a call of its own would give).
        first = [ends[i] - 1 - n for i, n in zip(sampling_rows, counts)]
        guessed = [p + 1 + j for p, n in zip(first, counts) for j in range(n)]
        # Prompt logprobs: more rows of the same product, after the sampled ones.
        prompt_rows, prompt_spans = _prompt_rows(chunks, ends)
        # Embedding requests' rows (every row for mean pooling, the last chunk's last for last): the
        # same gather, after those; their hidden states are the pooled inputs, no logits.
        pool_rows, pool_spans = _pool_rows(chunks, ends)
        rows = first + guessed + prompt_rows + pool_rows
        inputs, hidden = self._forward(chunks, rows, graphs=not prompt_rows and not pool_rows)
        if not rows:
            return StepResult([], None)
        selected = hidden.index_select(0, inputs.sample_rows)
        num_sampled = len(first) + len(guessed)
        prompt_end = num_sampled + len(prompt_rows)
        prompt = self._prompt_logprobs(selected[num_sampled:prompt_end], prompt_spans) if prompt_rows else []
        pooled, pool_failed = self._pool(selected[prompt_end:], pool_spans) if pool_spans else ([], [])
        if not sampling_rows:
            return StepResult([], None, failed=pool_failed, prompt_logprobs=prompt, pooled=pooled)
        result = self._sample(chunks, selected[:num_sampled], return_logits, guesses, sampling_rows, counts)
        if prompt or pooled or pool_failed:
            result = replace(result, prompt_logprobs=prompt, pooled=pooled, failed=[*result.failed, *pool_failed])
        return result

    def _pool(self, hidden: torch.Tensor, spans: list[tuple[ScheduledChunk, int]]) -> tuple[list[Pooled], list[tuple[str, str]]]:
        """Each embedding chunk's part of its request's vector, from `hidden` (their rows' hidden
        states, spans in order); the vectors of requests whose last chunk this is. A request whose
        pooling raises fails alone."""
        pooled, failed, row = [], [], 0
        for chunk, n in spans:
            rows, row = hidden[row : row + n], row + n
            try:
                vector = self._pool_chunk(chunk, rows)
            except Exception as exc:
                failed.append((chunk.request_id, f"pooling failed: {exc}"))
                continue
            if vector is not None:
                pooled.append(Pooled(chunk.request_id, tuple(vector.tolist())))
        return pooled, failed

    def _pool_chunk(self, chunk: ScheduledChunk, rows: torch.Tensor) -> torch.Tensor | None:
        params = chunk.params.pooling
        if params.pooling == "last":
            vector = rows[-1].float()
        else:
            # The running sum lives in the request's record; a chunk at position 0 starts it afresh
            # (the request was preempted and recomputes; mean pooling never takes a cached prefix).
            record = self._record(chunk)
            part = rows.float().sum(dim=0)
            if chunk.start_position == 0 or record.pooled_sum is None:
                record.pooled_sum, record.pooled_rows = part, 0
            else:
                record.pooled_sum += part
            record.pooled_rows += len(rows)
            if not chunk.pool:
                return None
            vector = record.pooled_sum / record.pooled_rows
        if params.dimensions is not None:
            if params.dimensions > vector.numel():
                raise ValueError(f"dimensions: {params.dimensions} exceeds the model's hidden size {vector.numel()}")
            vector = vector[: params.dimensions]
        if params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector

    def _sample(self, chunks, selected: torch.Tensor, return_logits: bool, guesses: dict[str, list[int]],
                sampling_rows: list[int], counts: list[int]) -> StepResult:
        """Sample each sampling chunk's token from `selected` (its hidden state, then its guessed
        positions'), and verify the guesses."""
        request_ids = [chunks[i].request_id for i in sampling_rows]
        num_first = len(sampling_rows)
        last_hidden = selected[:num_first]
        guess_logits = None
        if guesses:
            all_logits = self.model.compute_logits(selected)
            logits, guess_logits = all_logits[:num_first], all_logits[num_first:]
            guess_offset = dict(zip(request_ids, itertools.accumulate([0, *counts])))
        else:
            logits = self.model.compute_logits(last_hidden)
        guess_picks = None
        try:
            batch = self._batch(chunks, sampling_rows)
            if guess_logits is not None and self.sampling_pipeline.is_argmax(batch):
                # Greedy rows that nothing else touches: every position's token in one argmax,
                # exactly what the pipeline would pick position by position.
                picks = all_logits.argmax(dim=-1)
                sampled, guess_picks = SamplerOutput(token_ids=picks[:num_first]), picks[num_first:].tolist()
            else:
                sampled = self.sampling_pipeline(logits.clone() if return_logits else logits, batch)
        except SamplingError as exc:
            result = self._resample_without(exc, chunks, sampling_rows, last_hidden)
        else:
            result = StepResult(request_ids, sampled, logits.float() if return_logits else None)
        if guesses and result.sampled is not None:
            result = self._verify(result, chunks, guess_logits, guess_offset, guesses, guess_picks)
        return result

    def _add_guesses(self, chunks: Sequence[ScheduledChunk], failed: list) -> tuple[list[ScheduledChunk], dict[str, list[int]]]:
        """Append each speculating decode's guesses to its chunk (at most `num_speculative`)."""
        speculator, wanted, out = self.speculator, [], []
        for chunk in chunks:
            if not chunk.num_speculative or not chunk.sample:
                out.append(chunk)
                continue
            method = speculator.method_of(chunk.params)
            if method not in speculator.proposers:
                failed.append((chunk.request_id, f"speculative.method {method!r} is not built in this deployment; "
                               f"built: {', '.join(sorted(speculator.proposers)) or 'none'}"))
                continue
            record = self._record(chunk)  # cut back first: a proposer reads committed tokens only
            tokens = [*record.prompt_token_ids, *record.output_token_ids]
            greedy = (chunk.params or SamplingParams()).is_greedy
            wanted.append((chunk.request_id, method, tokens, chunk.num_speculative, greedy))
            out.append(chunk)
        # Sized proposals are trimmed to what pays in a step of this many rows (see sizing.py).
        guesses = speculator.propose(wanted, sum(len(c.token_ids) for c in out)) if wanted else {}
        out = [replace(c, token_ids=[*c.token_ids, *guesses[c.request_id]]) if c.request_id in guesses else c for c in out]
        self._methods = {entry[0]: entry[1] for entry in wanted}
        return out, guesses

    def _verify(self, result: StepResult, chunks, guess_logits: torch.Tensor, offset: dict[str, int],
                guesses: dict[str, list[int]], picks: list[int] | None = None) -> StepResult:
        """Keep each request's guesses while the token sampled before each equals it.

        Round i samples every still-matching request at its i-th guess's position through the
        whole pipeline, with the guesses accepted so far in its output (appended to the record),
        so processors and penalties see what they would without speculation. Sampling from the
        target and keeping a guess only if the sample equals it accepts guess x with probability
        p(x) and otherwise yields a sample from p without x, renormalised: the rejection rule for
        a proposer that is a point mass. So the tokens' distribution (greedy: the tokens
        themselves) is what it would be without speculation. `picks`: every guessed position's
        token already (a bare argmax, `SamplingPipeline.is_argmax`), so rounds only compare.
        """
        finals = result.sampled.token_ids.tolist()
        row_of = {request_id: row for row, request_id in enumerate(result.request_ids)}
        chunk_of = {c.request_id: i for i, c in enumerate(chunks)}
        accepted: dict[str, list[int]] = {r: [] for r in guesses if r in row_of}
        alive = list(accepted)
        # A request's guessed positions' logits are rows offset[request_id] on of `guess_logits`
        # (rounds take copies: processors edit logits in place).
        drop: set[str] = set()
        failed: list[tuple[str, str]] = []
        while alive:
            still = []
            for request_id in alive:
                done, guess = accepted[request_id], guesses[request_id]
                token = finals[row_of[request_id]]
                if len(done) < len(guess) and token == guess[len(done)] and not self._ends(chunks[chunk_of[request_id]], token):
                    done.append(token)
                    self._requests[request_id].output_token_ids.append(token)
                    still.append(request_id)
            alive = still
            if picks is not None:
                for request_id in alive:
                    finals[row_of[request_id]] = picks[offset[request_id] + len(accepted[request_id]) - 1]
                continue
            while alive:
                rows = [chunk_of[r] for r in alive]
                logits = guess_logits[[offset[r] + len(accepted[r]) - 1 for r in alive]]
                try:
                    sampled = self.sampling_pipeline(logits, self._batch(chunks, rows, cut_back=False))
                except SamplingError as exc:
                    blamed = {r for r in exc.rows if 0 <= r < len(alive)} or set(range(len(alive)))
                    failed += [(alive[r], exc.message_for(r)) for r in sorted(blamed)]
                    drop |= {alive[r] for r in blamed}
                    alive = [a for r, a in enumerate(alive) if r not in blamed]
                    continue
                for request_id, token in zip(alive, sampled.token_ids.tolist()):
                    finals[row_of[request_id]] = token
                break
        keep = [row for row, r in enumerate(result.request_ids) if r not in drop]
        sampled = _select_rows(result.sampled, keep) if drop else result.sampled
        sampled = replace(sampled, token_ids=torch.tensor([finals[i] for i in keep], dtype=sampled.token_ids.dtype))
        sized = self.speculator.sized
        speculated = [
            Speculation(r, self._methods[r], len(guesses[r]), len(accepted[r]), r in sized) for r in accepted if r not in drop
        ]
        return StepResult(
            [result.request_ids[i] for i in keep], sampled, result.logits, result.failed + failed,
            {r: a for r, a in accepted.items() if r not in drop}, speculated,
        )

    def _ends(self, chunk: ScheduledChunk, token: int) -> bool:
        """A guess that ends the request (EOS, a stop token id) is its last token: nothing after
        it is worth verifying."""
        params = chunk.params or SamplingParams()
        eos = token in self.sampling_pipeline.context.eos_token_ids and not params.ignore_eos
        return eos or token in params.stop_token_ids

    def finish_requests(self, request_ids: Sequence[str]) -> None:
        """The scheduler reports these requests gone: their records and the sampling plugins'
        state go."""
        if request_ids:
            for request_id in request_ids:
                self._requests.pop(request_id, None)
            self.sampling_pipeline.finish_requests(request_ids)
            if self.speculator is not None:
                self.speculator.finish_requests(request_ids)

    def _record(self, chunk: ScheduledChunk) -> _RequestRecord:
        """The request's record, made the first time it samples (its generator seeded then, as
        once per request: a preempted request recomputes, and goes on drawing from the same
        stream); tokens beyond `chunk.num_output_tokens` were sampled before a preemption and
        dropped by the scheduler, so they go here too."""
        record = self._requests.get(chunk.request_id)
        if record is None:
            seed = chunk.params.seed if chunk.params is not None else None
            # On the logits' device: a CPU generator cannot draw CUDA noise (torch refuses, which
            # failed every request batched with a seeded one).
            generator = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
            record = self._requests[chunk.request_id] = _RequestRecord(chunk.prompt_token_ids, generator=generator)
        elif chunk.num_output_tokens is not None and len(record.output_token_ids) > chunk.num_output_tokens:
            del record.output_token_ids[chunk.num_output_tokens :]
            if self.speculator is not None:  # a proposer's index of the dropped tokens is stale
                self.speculator.reset(chunk.request_id)
        return record

    def _batch(self, chunks: Sequence[ScheduledChunk], rows: list[int], cut_back: bool = True) -> SamplingBatch:
        """`cut_back=False`: the records as they are (verification has appended accepted guesses)."""
        if cut_back:
            records, failed = [], {}
            for row, i in enumerate(rows):
                try:
                    records.append(self._record(chunks[i]))
                except Exception as exc:  # a seed torch refuses: that request fails, the step goes on
                    failed[row] = f"the runner could not set up sampling for this request: {exc!r}"
            if failed:
                raise SamplingError("the runner", sorted(failed), "request setup failed", failed)
        else:
            records = [self._requests[chunks[i].request_id] for i in rows]
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

    def _prompt_logprobs(self, hidden: torch.Tensor, spans: list["_PromptSpan"]) -> list[PromptLogprobs]:
        """Each prompt row's next prompt token: its log-probability and rank under the raw model
        distribution (log-softmax in float32, before any processor, as `logprobs` reports) and the
        most likely tokens, from `hidden` (the prompt rows' hidden states, spans in order)."""
        k = max(1, *(span.top for span in spans))  # each span takes its own from these (0: none)
        targets = torch.tensor([t for span in spans for t in span.targets], dtype=torch.long).to(hidden.device)
        parts: list[list[torch.Tensor]] = []
        for lo in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[lo : lo + PROMPT_LOGPROB_ROWS]).float(), dim=-1)
            chosen = logprobs.gather(1, targets[lo : lo + PROMPT_LOGPROB_ROWS].unsqueeze(1))
            ranks = (logprobs > chosen).sum(dim=1) + 1
            top_values, top_ids = logprobs.topk(k, dim=-1)  # sorted, most likely first
            parts.append([chosen.squeeze(1), ranks, top_ids, top_values])
            del logprobs  # the slice's logits go before the next slice's come
        chosen, ranks, top_ids, top_values = (torch.cat(p).tolist() for p in zip(*parts))
        out, row = [], 0
        for span in spans:
            entries = []
            for target in span.targets:
                top = tuple(zip(top_ids[row][: span.top], top_values[row][: span.top]))
                entries.append(TokenLogprob(target, chosen[row], top, ranks[row]))
                row += 1
            out.append(PromptLogprobs(span.request_id, span.start, tuple(entries)))
        return out

    def _forward(self, chunks: Sequence[ScheduledChunk], sample_rows: list[int], graphs: bool = True) -> tuple[StepInputs, torch.Tensor]:
        """The step's packed inputs and the model's hidden states for them (through the decode
        graphs where they take the step and `graphs` allows: a padded step has one sampled row a
        sequence, so prompt logprobs' rows never go there)."""
        if graphs and self.graphs is not None and self.graphs.takes(chunks):
            return self.graphs.run(chunks, sample_rows)
        inputs = self._packer.pack(chunks, sample_rows)
        return inputs, self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend)


class _HostOutputs:
    """Brings a step's sampled outputs to the host in one pinned, non-blocking copy per tensor and
    one wait, so the compute thread blocks once a step (the event loop schedules meanwhile)."""

    def __init__(self, device: torch.device) -> None:
        self._on_cuda = torch.device(device).type == "cuda"
        self._pinned: dict[torch.dtype, torch.Tensor] = {}

    def _buffer(self, like: torch.Tensor, offset: int) -> torch.Tensor:
        need = offset + like.numel()
        held = self._pinned.get(like.dtype)
        if held is None or held.numel() < need:
            held = self._pinned[like.dtype] = torch.empty(max(need, 1024), dtype=like.dtype, pin_memory=True)
        return held[offset:need].view(like.shape)

    def fetch(self, output: SamplerOutput) -> SamplerOutput:
        if not self._on_cuda or output.token_ids.device.type == "cpu":
            return output
        tensors = [output.token_ids, output.logprobs, *(output.top_logprobs or ())]
        offsets: dict[torch.dtype, int] = {}
        host = []
        for t in tensors:
            if t is None:
                host.append(None)
                continue
            buffer = self._buffer(t, offsets.get(t.dtype, 0))
            offsets[t.dtype] = offsets.get(t.dtype, 0) + t.numel()
            host.append(buffer.copy_(t, non_blocking=True))
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        # Copies out of the pinned buffers: the next step reuses them.
        token_ids, logprobs, *top = (None if t is None else t.clone() for t in host)
        return SamplerOutput(token_ids, logprobs, tuple(top) if output.top_logprobs is not None else None)


@dataclass(frozen=True, slots=True)
class _PromptSpan:
    """One chunk's prompt rows: the next prompt tokens `targets`, the first at position `start`,
    with the `top` most likely tokens each."""

    request_id: str
    start: int
    targets: Sequence[int]
    top: int


def _prompt_rows(chunks: Sequence[ScheduledChunk], ends: list[int]) -> tuple[list[int], list[_PromptSpan]]:
    """The flat rows whose logits give prompt logprobs (each chunk's positions from its
    `prompt_logprobs_from` on that have a next prompt token) and what each chunk's rows report."""
    rows: list[int] = []
    spans: list[_PromptSpan] = []
    for chunk, end in zip(chunks, ends):
        if chunk.prompt_logprobs_from is None:
            continue
        start = chunk.start_position
        lo = max(start, chunk.prompt_logprobs_from)
        hi = min(start + len(chunk.token_ids), len(chunk.prompt_token_ids) - 1)
        if lo >= hi:
            continue
        base = end - len(chunk.token_ids) - start  # the flat row of position 0
        rows.extend(range(base + lo, base + hi))
        top = (chunk.params.prompt_logprobs or 0) if chunk.params is not None else 0
        spans.append(_PromptSpan(chunk.request_id, lo + 1, chunk.prompt_token_ids[lo + 1 : hi + 1], top))
    return rows, spans


def _pool_rows(chunks: Sequence[ScheduledChunk], ends: list[int]) -> tuple[list[int], list[tuple[ScheduledChunk, int]]]:
    """The flat rows embedding chunks pool from (every row for mean pooling; the last row of the
    last chunk for last pooling) and each such chunk with its number of rows."""
    rows: list[int] = []
    spans: list[tuple[ScheduledChunk, int]] = []
    for chunk, end in zip(chunks, ends):
        pooling = chunk.params.pooling if chunk.params is not None else None
        if pooling is None:
            continue
        if pooling.pooling == "mean":
            rows.extend(range(end - len(chunk.token_ids), end))
            spans.append((chunk, len(chunk.token_ids)))
        elif chunk.pool:
            rows.append(end - 1)
            spans.append((chunk, 1))
    return rows, spans


def _select_rows(output: SamplerOutput, rows: list[int]) -> SamplerOutput:
    index = torch.tensor(rows, dtype=torch.long)
    top = output.top_logprobs
    return SamplerOutput(
        output.token_ids.index_select(0, index),
        None if output.logprobs is None else output.logprobs.index_select(0, index),
        None if top is None else (top[0].index_select(0, index), top[1].index_select(0, index)),
    )
