"""How many of a proposal's guesses to verify, judged from how long its match is: the runner's side.

A lookup proposer (`ngram`, `suffix`) copies its guess from after an earlier occurrence of the
request's last m tokens, and m predicts the guess: on the bench's edit workload (greedy) a match of
1 token had its first guess kept 35% of the time, of 2 tokens 63%, of 4 tokens 87%, of 12 or more
nearly always. While the copy holds, each kept guess makes the match one token longer, so the j-th
guess (from 0) stands behind a match of m + j tokens. Where the match occurred more than once and
the occurrences continue differently, the guess (the latest one's) is much less sure: on that
workload a one-token match's first guess was kept 17% of the time when they split, 62% when they
agreed (`Proposal.agreed`). The runner keeps, per proposer and for greedy and sampled requests
apart (temperature changes what is kept), a table p(L, agreed): how often a guess behind a match
of L tokens was kept, given the guesses before it in its proposal were (decayed counts over
verified guesses, L capped at `MAX_MATCH`). k guesses then yield
1 + sum_{j<k} prod_{i<=j} p(m + i, agreed_i) tokens, and the runner keeps the k with the most tokens per
unit of step cost (measured from its own steps), 0 when none clearly beats a plain decode.

Against sizing every proposal from one running acceptance estimate per request, this decoded the
bench's edit workload 2-3% faster natively (AVX-512) and 3-9% faster as AVX2 (docs/speculative.md,
"Benchmark").
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

from cadenza.speculative.policy import StepCost, best_num_tokens

MAX_MATCH = 32  # matches at least this long share the table's last row
_PRIOR = (1.5, 0.5)  # (kept, seen - kept) pseudo-counts of a fresh row: p = 0.75
_DECAY = 0.995  # weight of the past at each new guess counted in a row


class MatchAcceptance:
    """p(L, agreed), L = 0..MAX_MATCH: the chance that a guess behind a match of L tokens is kept,
    apart for guesses on which the match's earlier occurrences agreed or split (`Proposal.agreed`;
    a proposer that does not say counts as agreed)."""

    def __init__(self) -> None:
        self._kept = {agreed: [_PRIOR[0]] * (MAX_MATCH + 1) for agreed in (True, False)}
        self._seen = {agreed: [_PRIOR[0] + _PRIOR[1]] * (MAX_MATCH + 1) for agreed in (True, False)}

    def probability(self, match_length: int, agreed: bool = True) -> float:
        row = min(max(match_length, 0), MAX_MATCH)
        return self._kept[agreed][row] / self._seen[agreed][row]

    def record(self, match_length: int, proposed: int, accepted: int, agreed: Sequence[bool] | None = None) -> None:
        """A proposal of `proposed` guesses behind a match of `match_length` tokens had its first
        `accepted` kept: each guess up to and including the first rejected one counts, at its own
        match length and agreement (the guesses after a rejection were never judged)."""
        for j in range(min(accepted + 1, proposed)):
            row = min(max(match_length + j, 0), MAX_MATCH)
            kept, seen = self._kept[_agreed(agreed, j)], self._seen[_agreed(agreed, j)]
            kept[row] = _DECAY * kept[row] + (j < accepted)
            seen[row] = _DECAY * seen[row] + 1


def _agreed(agreed: Sequence[bool] | None, j: int) -> bool:
    return True if agreed is None or j >= len(agreed) else bool(agreed[j])


def best_length(acceptance: MatchAcceptance, match_length: int, num_tokens: int, relative: Callable[[int], float],
                agreed: Sequence[bool] | None = None) -> int:  # fmt: skip
    """The k in 0..num_tokens with the most expected tokens per unit of step cost, a guess behind
    a match of `match_length` tokens (`agreed`: per guessed token, see `Proposal`); `relative(k)`:
    a step with k guesses over one without. The j-th guess stands behind a match of
    `match_length + j` tokens."""
    return best_num_tokens(lambda j: acceptance.probability(match_length + j, _agreed(agreed, j)), relative, num_tokens)


class GuessSizer:
    """The runner's acceptance tables (one per proposer and greedy or sampled) and its step cost:
    measured from its steps, or `token_cost` c for a step of 1 + c*k (`speculative.token_cost`)."""

    def __init__(self, token_cost: float | None = None) -> None:
        self.cost = StepCost()
        self.token_cost = token_cost
        self.tables: dict[Hashable, MatchAcceptance] = {}

    def size(self, key: Hashable, match_length: int, num_tokens: int, num_rows: int,
             agreed: Sequence[bool] | None = None) -> int:  # fmt: skip
        """Guesses to keep of a proposal of `num_tokens` behind a match of `match_length`, in a
        step of `num_rows` rows without them."""
        table = self.tables.get(key)
        if table is None:
            table = self.tables[key] = MatchAcceptance()
        if self.token_cost is not None:
            relative = lambda k: 1 + self.token_cost * k  # noqa: E731
        else:
            relative = lambda k: self.cost.relative(num_rows, k)  # noqa: E731
        return best_length(table, match_length, num_tokens, relative, agreed)

    def record(self, key: Hashable, match_length: int, proposed: int, accepted: int,
               agreed: Sequence[bool] | None = None) -> None:  # fmt: skip
        if proposed > 0:
            table = self.tables.get(key)
            if table is None:
                table = self.tables[key] = MatchAcceptance()
            table.record(match_length, proposed, accepted, agreed)

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """A step ran `num_rows` rows (guesses included) in `seconds`."""
        if num_rows > 0 and seconds > 0:
            self.cost.observe(num_rows, seconds)
