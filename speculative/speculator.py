"""The runner's side of speculation: asks the proposers for guesses, once a step.

The scheduler reserves room for `ScheduledChunk.num_speculative` guesses after a decode's token;
this asks the request's proposer (its own pick, else the deployment's) for at most that many and
the runner appends them to the chunk, so the model scores them all in the one pass. A proposal
that gives its match length (`Proposal`) is first trimmed to the length that pays
(`cadenza.speculative.sizing`), learned from what the step's verification kept.
"""

from __future__ import annotations

import operator
from typing import Mapping, Sequence

import structlog

from cadenza.speculative.base import Proposal, ProposalRequest, Proposer
from cadenza.speculative.sizing import GuessSizer
from cadenza.step import Speculation

log = structlog.get_logger(__name__)


class UnknownProposerError(ValueError):
    """A request named a proposer this deployment did not build."""


class Speculator:
    """The deployment's proposers by name, and which one requests get by default."""

    def __init__(self, proposers: Mapping[str, Proposer], default_method: str, vocab_size: int,
                 token_cost: float | None = None) -> None:  # fmt: skip
        """`token_cost`: `speculative.token_cost`, pinning the step cost sized guesses are judged by."""
        if default_method != "none" and default_method not in proposers:
            raise UnknownProposerError(f"speculative.method {default_method!r} was not built; built: {sorted(proposers)}")
        self.proposers = dict(proposers)
        self.default_method = default_method
        self.vocab_size = vocab_size
        self.sizer = GuessSizer(token_cost)
        # This step's proposals that gave a match length: request id -> (table key, match length, agreement).
        self.sized: dict[str, tuple[tuple[str, bool], int, Sequence[bool] | None]] = {}

    def method_of(self, params) -> str:
        override = params.speculative if params is not None else None
        if override is not None and override.method is not None:
            return override.method
        return self.default_method

    def propose(self, wanted: Sequence[tuple[str, str, Sequence[int], int, bool]], num_rows: int = 1) -> dict[str, list[int]]:
        """Guesses by request id, for (request id, method, tokens so far, most guesses, greedy)
        entries, in a step of `num_rows` rows before guesses. A proposal with a match length is
        trimmed to what pays (`sized` names those, trimmed to nothing included); a request whose
        proposer found nothing, or failed, has no entry."""
        by_method: dict[str, list[tuple[ProposalRequest, bool]]] = {}
        for request_id, method, tokens, num_tokens, greedy in wanted:
            by_method.setdefault(method, []).append((ProposalRequest(request_id, tokens, num_tokens), greedy))
        guesses: dict[str, list[int]] = {}
        self.sized = {}
        for method, entries in by_method.items():
            proposer = self.proposers[method]
            try:
                found = list(proposer.propose([request for request, _ in entries]))
            except Exception as exc:  # a guess is an optimisation: the step decodes without it
                log.warning("Proposer failed", proposer=method, error=repr(exc))
                continue
            for (request, greedy), proposal in zip(entries, found):
                try:  # a malformed answer loses its own guess, never the step
                    clean, match_length, agreed = _normalise(proposal, request.num_tokens)
                except (TypeError, ValueError) as exc:
                    log.warning("Proposer answered malformed", proposer=method, request_id=request.request_id, error=repr(exc))
                    continue
                if not clean or not all(0 <= t < self.vocab_size for t in clean):
                    continue
                if match_length is not None:
                    key = (method, greedy)
                    clean = clean[: self.sizer.size(key, match_length, len(clean), num_rows, agreed)]
                    self.sized[request.request_id] = (key, match_length, agreed)
                    num_rows += len(clean)
                if clean:
                    guesses[request.request_id] = clean
        return guesses

    def learn(self, outcomes: Sequence[Speculation]) -> None:
        """What verification kept of this step's sized proposals."""
        for outcome in outcomes:
            entry = self.sized.get(outcome.request_id)
            if entry is not None:
                key, match_length, agreed = entry
                self.sizer.record(key, match_length, outcome.proposed, outcome.accepted, agreed)

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """A step ran `num_rows` rows, guesses included, in `seconds` (the sizing's step cost)."""
        self.sizer.observe_step(num_rows, seconds)

    def reset(self, request_id: str) -> None:
        for proposer in self.proposers.values():
            self._quietly(proposer.on_request_reset, proposer, request_id)

    def finish_requests(self, request_ids: Sequence[str]) -> None:
        for proposer in self.proposers.values():
            for request_id in request_ids:
                self._quietly(proposer.on_request_finished, proposer, request_id)

    @staticmethod
    def _quietly(hook, proposer: Proposer, request_id: str) -> None:
        try:
            hook(request_id)
        except Exception as exc:
            log.warning("Proposer failed in a request hook", proposer=proposer.name, request_id=request_id, error=repr(exc))


def _normalise(proposal, num_tokens: int) -> tuple[list[int], int | None, tuple[bool, ...] | None]:
    """A proposer's answer for one request as (token ids, match length, agreement); raises
    TypeError or ValueError for one that is neither a sequence of ids nor a `Proposal`."""
    match_length = agreed = None
    if isinstance(proposal, Proposal):
        proposal, match_length, agreed = proposal.token_ids, proposal.match_length, proposal.agreed
        match_length = None if match_length is None else operator.index(match_length)
        agreed = None if agreed is None else tuple(bool(flag) for flag in agreed)
    return [operator.index(t) for t in list(proposal)[:num_tokens]], match_length, agreed
