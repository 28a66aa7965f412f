"""The scheduler's record of one request: its tokens and where it stands, never its blocks (the
cache manager owns those, and each step's grant carries them to the runner)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cadenza.outputs import TokenLogprob
from cadenza.sampling_params import SamplingParams
from cadenza.speculative.policy import SpeculationState
from cadenza.step import PENDING_TOKEN


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the request's blocks
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied at first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    sequence_number: int = 0  # admission order, breaks ties in the queue
    num_pending: int = 0  # tokens being sampled by steps in flight
    epoch: int = 0  # bumped on preemption: results of steps planned before it are stale
    num_draft_slots: int = 0  # guesses the step in flight may verify past num_computed_tokens
    speculation: SpeculationState | None = None  # its recent speculation, once it has decoded
    # Prompt logprobs (params.prompt_logprobs): those computed and not handed over yet (from
    # position 1, until its first token carries them out), and how many positions have had theirs
    # (a preempted request does not report those again).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_logprobs: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Tokens once the steps in flight have delivered theirs."""
        return self.num_tokens + self.num_pending

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some prompt position has not had its own yet."""
        return self.params.prompt_logprobs is not None and self.num_prompt_logprobs < self.num_prompt_tokens - 1

    @property
    def is_pooling(self) -> bool:
        """An embedding request: prefill only, its last chunk pools instead of sampling."""
        return self.params.pooling is not None

    @property
    def max_cached_tokens(self) -> int | None:
        """The most leading tokens the prefix cache may supply (None: any): a request owed prompt
        logprobs computes every position that has not had its logprob (vLLM's rule), and mean
        pooling needs every prompt row's hidden state, though the blocks either computes are
        cached for others like any."""
        if self.is_pooling and self.params.pooling.pooling == "mean":
            return 0
        return self.num_prompt_logprobs if self.wants_prompt_logprobs else None

    def take_prompt_logprobs(self) -> tuple[TokenLogprob | None, ...] | None:
        """Its prompt logprobs, one per prompt token (None for the first), handed over once."""
        if self.params.prompt_logprobs is None:
            return None
        entries, self.prompt_logprobs = self.prompt_logprobs, []
        return (None, *entries)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list; positions
        whose token a step in flight is still sampling read `PENDING_TOKEN`."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return list(prompt[start:end])
        known = self.num_tokens
        pending = [PENDING_TOKEN] * (end - max(start, known)) if end > known else []
        end = min(end, known)
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt) : end - len(prompt)] + pending
        return list(prompt[start:]) + self.output_token_ids[: end - len(prompt)] + pending

    def all_tokens(self) -> tuple[int, ...]:
        return self.prompt_token_ids + tuple(self.output_token_ids)

    def queue_key(self, policy: str) -> tuple:
        if policy == "priority":
            return (self.priority, self.arrival_time, self.sequence_number)
        return (self.arrival_time, self.sequence_number)
