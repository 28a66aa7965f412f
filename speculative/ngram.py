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

from cadenza.speculative.base import ProposalRequest, Proposer


class NgramOptions(BaseModel):
    """`plugin_options.ngram`: the n-gram lengths matched, the longest found winning. A longer
    match is a more specific one: edits and code repeat short n-grams everywhere, so max_n 8
    keeps about 5% more guesses than 4 on the bench's edit workload."""

    min_n: int = Field(2, ge=1, le=16, description="Shortest suffix matched.")
    max_n: int = Field(8, ge=1, le=16, description="Longest suffix matched: the longest match found wins.")
    window: int = Field(4096, ge=16, description="Only the last this many tokens are searched.")

    @model_validator(mode="after")
    def _ordered(self) -> "NgramOptions":
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """The tokens after the latest earlier occurrence of `tokens`' longest suffix of `min_n` to
    `max_n` tokens (the longest length found wins); [] when no suffix of those lengths occurred
    before.

    One pass, whatever `max_n`: every earlier position holding the last token is a candidate end,
    and each candidate's match is grown backwards while it lasts."""
    length = tokens.shape[0]
    if length < 2:
        return []
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # ends before the suffix's own
    if ends.size == 0:
        return []
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
        return []
    end = int(ends[np.flatnonzero(matched == best)[-1]])
    return copy_forward(tokens.tolist(), end + 1, num_tokens)


def copy_forward(tokens: list[int], start: int, num_tokens: int) -> list[int]:
    """`num_tokens` tokens copied from `start` on, reading past the end into the copy itself (as
    LZ77 does): a match close behind the end is a repeating loop, and this continues the loop
    instead of stopping at the end."""
    out: list[int] = []
    length = len(tokens)
    for i in range(start, start + num_tokens):
        out.append(tokens[i] if i < length else out[i - length])
    return out


class NgramProposer(Proposer):
    """Prompt lookup decoding (vLLM's `ngram`, llama.cpp's lookup)."""

    name = "ngram"
    options_model = NgramOptions

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Sequence[int]]:
        options = self.options
        guesses = []
        for request in requests:
            tokens = np.asarray(request.token_ids[-options.window :], dtype=np.int64)
            guesses.append(ngram_lookup(tokens, options.min_n, options.max_n, request.num_tokens))
        return guesses
