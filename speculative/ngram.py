"""`ngram`: prompt lookup. The request's last n tokens are searched for earlier in its own tokens
(prompt and output), n from `max_n` down to `min_n`; the tokens that followed the latest earlier
match of the longest n found are the guess.

Edits, summaries, code changes and answers that quote the prompt repeat long runs of it, which is
where this pays. Stateless: nothing is kept between steps.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from pydantic import BaseModel, Field, model_validator

from cadenza.speculative.base import Proposal, ProposalRequest, Proposer
from cadenza.speculative.sizing import MAX_MATCH


class NgramOptions(BaseModel):
    """`plugin_options.ngram`: the n-gram lengths matched, the longest found winning. A longer
    match is a more specific one: edits and code repeat short n-grams everywhere, so max_n 8
    keeps about 5% more guesses than 4 on the bench's edit workload. A one-token match is worth
    proposing: the runner judges it by its length (speculative/sizing.py) and verifies its guess
    only where such guesses have paid."""

    min_n: int = Field(1, ge=1, le=16, description="Shortest suffix matched.")
    max_n: int = Field(8, ge=1, le=16, description="Longest suffix matched: the longest match found wins.")
    window: int = Field(4096, ge=16, description="Only the last this many tokens are searched.")

    @model_validator(mode="after")
    def _ordered(self) -> "NgramOptions":
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self


# How far back the chosen match is followed to judge it (past `max_n`): the runner's acceptance
# table has no rows beyond this length, a copy that long being near sure.
CONFIDENCE_LENGTH = MAX_MATCH


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """The tokens after the latest earlier occurrence of `tokens`' longest suffix of `min_n` to
    `max_n` tokens (the longest length found wins); [] when no suffix of those lengths occurred
    before."""
    return ngram_match(tokens, min_n, max_n, num_tokens)[0]


def ngram_match(tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int) -> tuple[list[int], int, list[bool]]:
    """`ngram_lookup`'s guess, how long the match it copies from is (the chosen occurrence's match
    followed back past `max_n`, up to `CONFIDENCE_LENGTH`; 0: no match), and for each guessed token
    whether every occurrence of the longest match that still led there continued with it.

    One pass, whatever `max_n`: every earlier position holding the last token is a candidate end,
    and each candidate's match is grown backwards while it lasts."""
    length = tokens.shape[0]
    if length < 2:
        return [], 0, []
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # ends before the suffix's own
    if ends.size == 0:
        return [], 0, []
    matched = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(max_n, length - 1)):
        at = ends - back
        alive &= at >= 0
        alive[alive] = tokens[at[alive]] == tokens[length - 1 - back]
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return [], best, []
    occurrences = ends[matched == best]
    end = int(occurrences[-1])
    span = min(CONFIDENCE_LENGTH, end + 1)
    differ = np.flatnonzero(tokens[end + 1 - span : end + 1] != tokens[length - span :])
    match_length = span - 1 - int(differ[-1]) if differ.size else span
    guess = copy_forward(tokens[end + 1 : end + 1 + num_tokens].tolist(), 0, num_tokens)
    return guess, match_length, agreement(tokens, occurrences, guess)


def agreement(tokens: np.ndarray, occurrences: np.ndarray, guess: list[int]) -> list[bool]:
    """For each guessed token, whether the occurrences (match ends) that continued as the guess so
    far all continue with it; occurrences that reach the end of `tokens` stop voting."""
    agreed, live = [], occurrences
    for j, token in enumerate(guess):
        at = live + 1 + j
        live, at = live[at < tokens.shape[0]], at[at < tokens.shape[0]]
        following = tokens[at]
        same = following == token
        agreed.append(bool(same.all()))
        live = live[same]
    return agreed


def copy_forward(tokens: Sequence[int], start: int, num_tokens: int) -> list[int]:
    """`num_tokens` tokens copied from `start` on, reading past the end into the copy itself (as
    LZ77 does): a match close behind the end is a repeating loop, and this continues the loop
    instead of stopping at the end."""
    run = list(tokens[start : start + num_tokens])
    if run and len(run) < num_tokens:  # the run reached the end: it repeats with its own length
        run = (run * (num_tokens // len(run) + 1))[:num_tokens]
    return run


class NgramProposer(Proposer):
    """Prompt lookup decoding (vLLM's `ngram`, llama.cpp's lookup)."""

    name = "ngram"
    options_model = NgramOptions

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        options = self.options
        guesses = []
        for request in requests:
            tokens = np.asarray(request.token_ids[-options.window :], dtype=np.int64)
            guesses.append(Proposal(*ngram_match(tokens, options.min_n, options.max_n, request.num_tokens)))
        return guesses
