"""The values a step is made of, shared by the scheduler, the runner and the model runner.

Plain data: importing this costs no torch and no model, so the scheduler and the messages can use
it without loading either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cadenza.outputs import TokenLogprob
from cadenza.sampling_params import SamplingParams

# A decode scheduled before the step that samples its input token has finished carries this in
# place of the token; the runner fills in what that step sampled (steps run in order).
PENDING_TOKEN = -1


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """New tokens of one sequence to run this step.

    `token_ids` sit at positions `start_position ..`; the tokens before them are already cached in
    `block_table` (the cache manager's table for this step), which covers every position this step
    writes. When `sample` is set (a decode, or the last chunk of a prompt) the step picks the
    sequence's next token from its last position. A decode's token may be `PENDING_TOKEN`: the
    token the previous step sampled for this request.

    The runner keeps what sampling reads per request (the prompt, the tokens sampled so far, the
    seeded generator): `prompt_token_ids` is the request's prompt (the scheduler's own tuple, not
    a copy), and `num_output_tokens` how many output tokens the request has before this chunk
    samples, counting the ones steps in flight are sampling. The runner drops any it holds beyond
    that (sampled before a preemption, and discarded by the scheduler); None trusts the runner's
    record as it is (for callers that drive the model runner directly).

    `num_speculative` (a decode only): the most tokens the runner may guess after `token_ids` and
    verify in the same pass; `block_table` covers them too. The step then returns up to that many
    accepted guesses and one token more (see docs/speculative.md).

    `prompt_logprobs_from` (a prompt chunk of a request with `params.prompt_logprobs`): each of the
    chunk's positions from this one on that has a next prompt token reports that token's
    log-probability from its own logits (`PromptLogprobs`); positions before it reported theirs
    before a preemption. None: the chunk reports none.

    An embedding request's chunks (`params.pooling` set) never sample: their rows' hidden states
    feed its pooled vector (every row for `mean`, the last row of the last chunk for `last`), and
    `pool` is set on the chunk that ends its prompt, when the runner reports the vector
    (`Pooled`). A chunk at position 0 starts the request's pooling afresh (after a preemption).
    """

    request_id: str
    token_ids: Sequence[int]
    start_position: int
    block_table: Sequence[int]
    sample: bool = True
    params: SamplingParams | None = None
    prompt_token_ids: Sequence[int] = ()
    num_output_tokens: int | None = None
    num_speculative: int = 0
    prompt_logprobs_from: int | None = None
    pool: bool = False


@dataclass(frozen=True, slots=True)
class Speculation:
    """What one request's speculative step did: the `method` that guessed, how many tokens it
    `proposed`, and how many of them the model `accepted` (they lead the request's sampled tokens).

    `sized`: the runner chose how many to propose itself, from the proposer's match length
    (`cadenza.speculative.sizing`); `proposed` 0 then means it judged none worth verifying, not
    that the proposer found nothing."""

    request_id: str
    method: str
    proposed: int
    accepted: int
    sized: bool = False


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A step's prompt logprobs for one request: `entries[i]` is prompt token `start + i`'s
    log-probability given the tokens before it (`start` >= 1: the first token has none)."""

    request_id: str
    start: int
    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True, slots=True)
class Pooled:
    """An embedding request's vector, pooled from its prompt's last hidden states (as its
    `PoolingParams` say: pooled, truncated, normalized), reported by the step of its last chunk."""

    request_id: str
    embedding: tuple[float, ...]
