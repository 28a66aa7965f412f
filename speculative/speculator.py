"""The runner's side of speculation: asks the proposers for guesses, once a step.

The scheduler reserves room for `ScheduledChunk.num_speculative` guesses after a decode's token;
this asks the request's proposer (its own pick, else the deployment's) for at most that many and
the runner appends them to the chunk, so the model scores them all in the one pass.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import structlog

from cadenza.speculative.base import ProposalRequest, Proposer

log = structlog.get_logger(__name__)


class UnknownProposerError(ValueError):
    """A request named a proposer this deployment did not build."""


class Speculator:
    """The deployment's proposers by name, and which one requests get by default."""

    def __init__(self, proposers: Mapping[str, Proposer], default_method: str, vocab_size: int) -> None:
        if default_method != "none" and default_method not in proposers:
            raise UnknownProposerError(f"speculative.method {default_method!r} was not built; built: {sorted(proposers)}")
        self.proposers = dict(proposers)
        self.default_method = default_method
        self.vocab_size = vocab_size

    def method_of(self, params) -> str:
        override = params.speculative if params is not None else None
        if override is not None and override.method is not None:
            return override.method
        return self.default_method

    def propose(self, wanted: Sequence[tuple[str, str, Sequence[int], int]]) -> dict[str, list[int]]:
        """Guesses by request id, for (request id, method, tokens so far, most guesses) entries;
        requests whose method was not built raise `UnknownProposerError` in their entry's place
        (returned in `errors`)."""
        by_method: dict[str, list[ProposalRequest]] = {}
        for request_id, method, tokens, num_tokens in wanted:
            by_method.setdefault(method, []).append(ProposalRequest(request_id, tokens, num_tokens))
        guesses: dict[str, list[int]] = {}
        for method, requests in by_method.items():
            proposer = self.proposers[method]
            try:
                found = proposer.propose(requests)
            except Exception as exc:  # a guess is an optimisation: the step decodes without it
                log.warning("Proposer failed", proposer=method, error=repr(exc))
                continue
            for request, tokens in zip(requests, found):
                clean = [int(t) for t in list(tokens)[: request.num_tokens]]
                if clean and all(0 <= t < self.vocab_size for t in clean):
                    guesses[request.request_id] = clean
        return guesses

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
