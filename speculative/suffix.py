"""`suffix`: a suffix automaton over each request's tokens finds the longest suffix that occurred
before, at any length, and guesses the tokens that followed its first occurrence.

Unlike `ngram`, which tries a few fixed lengths, the automaton matches however long the repeat is,
so a long quoted passage is followed however far back it started. It grows by one token in
amortised constant time, so each step costs only the tokens added since the last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pydantic import BaseModel, Field

from cadenza.speculative.base import Proposal, ProposalRequest, Proposer
from cadenza.speculative.ngram import copy_forward


class SuffixOptions(BaseModel):
    """`plugin_options.suffix`."""

    min_match: int = Field(1, ge=1, le=64, description="Shortest repeated suffix worth guessing from "
                           "(the runner trims the guesses of short matches that do not pay).")


@dataclass(slots=True)
class SuffixAutomaton:
    """The classic online suffix automaton (Blumer et al.) over token ids.

    State 0 is the empty string. Per state: `length` of its longest string, `link` (suffix link),
    `next` (transitions) and `first_end`, the index of the last token of the state's first
    occurrence.
    """

    tokens: list[int] = field(default_factory=list)
    length: list[int] = field(default_factory=lambda: [0])
    link: list[int] = field(default_factory=lambda: [-1])
    next: list[dict[int, int]] = field(default_factory=lambda: [{}])
    first_end: list[int] = field(default_factory=lambda: [-1])
    last: int = 0

    def extend(self, token: int) -> None:
        length, link, nxt, first_end = self.length, self.link, self.next, self.first_end
        position = len(self.tokens)
        self.tokens.append(token)
        cur = len(length)
        length.append(length[self.last] + 1)
        link.append(-1)
        nxt.append({})
        first_end.append(position)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                length.append(length[p] + 1)
                link.append(link[q])
                nxt.append(dict(nxt[q]))
                first_end.append(first_end[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def continuation(self, min_match: int, num_tokens: int) -> list[int]:
        """The tokens after the first occurrence of the longest suffix that occurred before (at
        least `min_match` long); [] if there is none."""
        return self.match(min_match, num_tokens)[0]

    def match(self, min_match: int, num_tokens: int) -> tuple[list[int], int, list[bool]]:
        """`continuation`, the length of that suffix (0: none occurred before), and for each
        guessed token whether every earlier occurrence that led there continued with it: the
        state reached has that one transition (its end positions' next tokens)."""
        state = self.link[self.last]  # the longest suffix occurring at least twice
        length = self.length[state] if state > 0 else 0
        if length < max(min_match, 1):
            return [], length, []
        start = self.first_end[state] + 1  # < len(tokens): that occurrence ended earlier
        guess = copy_forward(self.tokens, start, num_tokens)
        agreed = []
        for token in guess:  # past the last occurrence (a loop read into its own copy) none disagree
            following = self.next[state] if state >= 0 else {}
            agreed.append(len(following) <= 1)
            state = following.get(token, -1)
        return guess, length, agreed


class SuffixProposer(Proposer):
    """Suffix-automaton lookup over the request's own tokens (prompt and output)."""

    name = "suffix"
    options_model = SuffixOptions

    def __init__(self, context, options=None) -> None:
        super().__init__(context, options)
        self._automata: dict[str, SuffixAutomaton] = {}

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        guesses = []
        for request in requests:
            automaton = self._automata.get(request.request_id)
            tokens = request.token_ids
            if automaton is None or len(automaton.tokens) > len(tokens):
                automaton = self._automata[request.request_id] = SuffixAutomaton()
            for token in tokens[len(automaton.tokens) :]:
                automaton.extend(token)
            guesses.append(Proposal(*automaton.match(self.options.min_match, request.num_tokens)))
        return guesses

    def on_request_finished(self, request_id: str) -> None:
        self._automata.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        """Requests holding an automaton (zero once every request has left)."""
        return len(self._automata)
