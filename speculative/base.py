"""The proposer contract: a plugin kind registered through the `register_proposers` hook.

A proposer guesses up to `num_tokens` tokens that may follow a request's tokens. Its guesses are
point masses (the proposer is deterministic): the runner verifies them by sampling the target
model at each guessed position exactly as it would without speculation and keeping a guess only
while the sampled token equals it (see `cadenza.speculative.verify`), so any guess, however bad,
leaves the output distribution unchanged; a good guess only saves steps.

A proposer that copies its guess from an earlier match may say how long that match is
(`Proposal.match_length`): the runner then sizes the guess itself, from how often guesses behind
matches of each length were kept (`cadenza.speculative.sizing`), and trims it, to nothing maybe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from pydantic import BaseModel


@dataclass(frozen=True, slots=True)
class ProposerContext:
    """What a proposer factory is told once, at engine start-up.

    `device` and `dtype` are the target model's (a draft model may run beside it); `tokenizer` is
    the target's tokenizer (proposers share it: tokens are compared by id); `model_path` the
    target's `model.path`.
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    device: Any = None
    dtype: Any = None
    tokenizer: Any = None
    model_path: str | None = None  # the target's `model.path` (None: the embedded default)
    # Builds a second model beside the target, for a proposer that drafts with one (the runtime's
    # `build_draft_model`, bound to the target's device): keyword arguments path, dtype ("auto",
    # "float32", ...), quantization, max_model_len, num_slots, block_size and eos_token_ids; returns a
    # `DraftModel`.
    load_draft: Callable[..., DraftModel] | None = None


@dataclass(frozen=True, slots=True)
class DraftModel:
    """A second model, its own paged cache and a greedy sampler, ready to run steps.

    `runner` runs `execute(chunks)` and `finish_requests(ids)` as the target's model runner does;
    its cache holds `num_slots` runs of `blocks_per_slot` blocks, one run a request."""

    runner: Any
    vocab_size: int
    max_model_len: int
    blocks_per_slot: int
    source: str


@dataclass(frozen=True, slots=True)
class ProposalRequest:
    """One request to guess for: its tokens so far (prompt and output, the runner's record: read
    them during the call, keep no reference) and the most tokens to guess."""

    request_id: str
    token_ids: Sequence[int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Proposal:
    """A guess and how long the match it was copied from is: the number of tokens that end the
    request's tokens and also occurred earlier, just before the copied ones (None: the proposer
    does not say; the guess is taken whole). A longer match is a surer guess; the runner trims the
    guess to the length that pays (`cadenza.speculative.sizing`).

    `agreed` (optional, one flag a guessed token): whether every earlier occurrence of the match
    that still led to this point continued with this token. A guess on which the occurrences split
    is kept far less often (on the bench's edit workload, a one-token match's first guess 17% of
    the time against 62% when they agree)."""

    token_ids: Sequence[int]
    match_length: int | None = None
    agreed: Sequence[bool] | None = None


class Proposer(ABC):
    """Guesses the next tokens of decoding requests. Called on the compute thread, once a step,
    for the requests that speculate in it; never concurrently with itself.

    A proposer may keep per-request state keyed by request id (an index over the tokens, a draft
    model's cache). The tokens it is given only grow from one call to the next, except after
    `on_request_reset`; `on_request_finished` follows when the request has left the engine.
    """

    name: ClassVar[str]
    # Deployment settings, from `plugin_options[name]` (validated at start-up); None: no options.
    options_model: ClassVar[type[BaseModel] | None] = None

    def __init__(self, context: ProposerContext, options: BaseModel | None = None) -> None:
        self.context = context
        if options is None and self.options_model is not None:
            options = self.options_model()
        self.options = options

    @abstractmethod
    def propose(self, requests: Sequence[ProposalRequest]) -> list[Sequence[int] | Proposal]:
        """Up to `num_tokens` guessed token ids per request, in order (empty: no guess), each a
        plain sequence or a `Proposal` that also gives its match length.

        Guesses beyond `num_tokens`, or ids outside the vocabulary, are cut off by the runner.
        A guess with a match length may be trimmed further: the runner keeps the number of tokens
        that pays, judged from the match length and the step's cost.
        Raising fails no request: the runner logs it and the step decodes without guesses.
        """

    def on_request_reset(self, request_id: str) -> None:
        """The request's tokens were cut back (a preemption dropped tokens sampled in flight):
        state built from its old tokens must go. The default forgets the request."""
        self.on_request_finished(request_id)

    def on_request_finished(self, request_id: str) -> None:
        """The request has left the engine: drop its state. Errors are logged, never raised."""
