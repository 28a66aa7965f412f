"""When a request speculates and how many tokens it asks for: the scheduler's side, plain Python.

A step verifying k guesses costs about `1 + c*k` plain decode steps, c the cost of one more token
in a step relative to a one-token step: near 0 where a step is bound by reading the weights (a
GPU at batch 1), near 1 where it is bound by compute (a small CPU). The policy estimates c from
the steps it sees (seconds against tokens: prefill chunks and speculative steps alike), unless
`speculative.token_cost` sets it, and, per
request, the chance `a` that a guess is accepted (a running estimate from what its last steps
kept). k guesses then yield (1 - a^(k+1)) / (1 - a) tokens, and the policy picks the k, up to the
request's cap, with the most tokens per unit of cost; 0 when no k beats a plain decode.

A request that is switched off that way waits `cooldown_steps` of its decodes (doubling each time
in a row, up to 16x), then probes with one guess to refresh its estimate. One whose proposer found
nothing for several steps in a row skips two decodes, then four, up to `cooldown_steps` while it
keeps finding nothing: a lookup is cheap, and a run worth copying may start at any token. A step decoding more than `max_batch_size` requests
speculates for none: a big batch is compute-bound. A request whose acceptance falls below
`min_acceptance` pauses whatever the cost says.

A proposer that gives its match length (`ngram`, `suffix`: `Proposal.match_length`) is sized by
the runner instead, guess by guess, from how long the match is (speculative/sizing.py): outcomes
the runner marks `sized` teach the policy that the method sizes itself, and from then on its
requests are given their whole cap (room permitting), with no acceptance estimate, pause or probe:
a lookup is cheap, and the runner trims a guess it does not trust, to nothing maybe. A proposal
trimmed to nothing is neither an empty proposal nor a rejection; but each ask gives up the step's
async overlap, so a request whose proposals were trimmed to nothing four times in a row skips one
decode, then two, then four while they keep being trimmed (sampled text that never repeats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cadenza.config.schema import SpeculativeConfig

_EMPTY_LIMIT = 4  # proposals in a row that found nothing before a request stops asking...
_EMPTY_PAUSE = 2  # ...for this many decodes, doubling while it keeps finding nothing (up to
# cooldown_steps): asking costs a lookup and the step's async overlap, but missing the start of a
# run the proposer could copy costs whole steps (edits, quotes)
_TRIMMED_LIMIT = 4  # sized proposals in a row trimmed to nothing before a request stops asking...
_TRIMMED_PAUSE = 4  # ...for 1, then 2, then up to this many decodes while they keep being trimmed:
# each ask gives up the step's async overlap; a copy found a few tokens late costs little, as the
# match found then is longer and its guess surer (no effect on the edit workload, where a one-token
# match's guess of one token already pays)
_MAX_BACKOFF = 16
_DECAY = 0.7  # weight of the past in the running sums
_PRIOR = (1.5, 0.5)  # (accepted, rejected) pseudo-counts of a fresh request: a = 0.75
_COST_PRIOR = 0.3  # c until steps of different sizes have been seen


@dataclass(slots=True)
class SpeculationState:
    """One request's recent speculation: its acceptance evidence and cooldown."""

    num_tokens: int  # the last k it was given
    accepted: float = _PRIOR[0]  # decayed counts of guesses kept and of rejections
    rejected: float = _PRIOR[1]
    empty_in_a_row: int = 0
    paused_for: int = 0  # decodes left before it speculates again
    backoff: int = 1
    probe: bool = False  # the next decode after a pause tries one guess, whatever the estimate
    probe_after_pause: bool = False  # set by an acceptance pause; an empty-proposal pause needs no probe
    empty_pause: int = _EMPTY_PAUSE  # the next pause for finding nothing
    trimmed_in_a_row: int = 0  # sized proposals the runner trimmed to nothing, in a row
    trimmed_pause: int = 1  # the next pause for those

    @property
    def acceptance(self) -> float:
        """The estimated chance that a guess is kept, given the one before it was."""
        return self.accepted / (self.accepted + self.rejected)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step with k guesses yields when each is kept with `acceptance` (the first miss
    ends the run, and the step always adds the model's own token)."""
    return sum(acceptance**i for i in range(k + 1))


def best_num_tokens(acceptance: float | Callable[[int], float], cost: float | Callable[[int], float], cap: int) -> int:
    """The k in 0..cap with the most tokens per unit of step cost (0: plain decoding wins).

    `acceptance`: the chance that a guess is kept once the guesses before it were, the same for
    every guess, or as a function of the guess's index j (from 0; the runner's sizing reads it
    from the match length). `cost`: what a step with k guesses costs relative to a plain decode,
    as a function of k, or a number c for 1 + c*k."""
    kept = acceptance if callable(acceptance) else (lambda j: acceptance)
    relative = cost if callable(cost) else (lambda k: 1 + cost * k)
    best, best_rate = 0, 1.0
    survive = expected = 1.0  # the chance that guesses 0..k-1 are all kept; tokens expected from k guesses
    for k in range(1, cap + 1):
        survive *= kept(k - 1)
        expected += survive
        rate = expected / relative(k)
        if rate > best_rate * 1.02:  # a clear win only: a tie is not worth the lost overlap
            best, best_rate = k, rate
    return best


class StepCost:
    """Seconds a step takes against its tokens: a decayed least-squares line (c = slope /
    (intercept + slope)), and a running average per step size for the small steps speculation
    makes, since the cost is not linear there (a one-token step takes the matrix-vector kernels;
    measured on two cores: 6.3 ms for 1 token, 10.8 for 2, 17.8 for 5, 23.6 for 8)."""

    _SMALL = 33  # step sizes measured one by one

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._by_size: dict[int, float] = {}

    def relative(self, base: int, k: int) -> float:
        """A step of `base + k` tokens over one of `base` tokens, measured where both sizes
        were seen, else from the line."""
        small, big = self._by_size.get(base), self._by_size.get(base + k)
        if small and big:
            return big / small
        return 1 + self.per_token * k

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < self._SMALL:
            seen = self._by_size.get(num_tokens)
            self._by_size[num_tokens] = seconds if seen is None else 0.8 * seen + 0.2 * seconds
        d = 0.98
        self._n = d * self._n + 1
        self._x = d * self._x + num_tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + num_tokens * num_tokens
        self._xy = d * self._xy + num_tokens * seconds

    @property
    def per_token(self) -> float:
        n = self._n
        spread = n * self._xx - self._x * self._x
        if n < 4 or spread <= 1e-9 * max(1.0, n * self._xx):
            return _COST_PRIOR
        slope = (n * self._xy - self._x * self._y) / spread
        intercept = (self._y - slope * self._x) / n
        one = intercept + slope  # a one-token step
        if one <= 0:
            return _COST_PRIOR
        return min(1.0, max(0.0, slope / one))


class SpeculationPolicy:
    """Decides per request and step how many tokens to propose (0: a plain decode)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.cost = StepCost()
        self.sizing_methods: set[str] = set()  # methods whose proposals the runner sizes itself

    def method_of(self, params) -> str:
        override = params.speculative
        if override is not None and override.method is not None:
            return override.method
        return self.config.method

    def cap(self, params) -> int:
        """The most tokens this request may propose a step (0: it never speculates)."""
        if self.method_of(params) == "none" or params.logprobs is not None:
            return 0  # log-probabilities are reported one token a step
        override = params.speculative
        if override is not None and override.num_tokens is not None:
            return override.num_tokens
        return self.config.num_tokens

    def num_tokens(self, request, num_running: int, room: int) -> int:
        """Tokens to propose for `request`'s decode this step; `room`: what the token budget,
        `max_tokens` and the context length leave beyond the decode's own token."""
        cap = min(self.cap(request.params), room)
        if cap <= 0:
            return 0
        state = request.speculation
        if state is None:
            state = request.speculation = SpeculationState(num_tokens=cap)
        if state.paused_for > 0:
            state.paused_for -= 1
            state.probe = state.paused_for == 0 and state.probe_after_pause
            return 0
        if num_running > self.config.max_batch_size:
            return 0
        if self.method_of(request.params) in self.sizing_methods:
            state.num_tokens = cap
            return cap
        if state.probe:  # one guess, so its estimate can recover when the text turns repetitive
            state.probe = False
            state.num_tokens = 1
            return 1
        if self.config.token_cost is not None:
            cost = self.config.token_cost
        else:  # a step of the running requests' decodes, with and without k guesses
            cost = lambda k: self.cost.relative(num_running, k)  # noqa: E731
        k = best_num_tokens(state.acceptance, cost, cap)
        if k == 0:
            self._pause(state)
        state.num_tokens = k
        return k

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step ran `num_tokens` tokens (guesses included) in `seconds`."""
        if num_tokens > 0 and seconds > 0:
            self.cost.observe(num_tokens, seconds)

    def record(self, request, proposed: int, accepted: int, sized: bool = False) -> None:
        """A speculative step of `request` came back: `proposed` guesses, `accepted` kept;
        `sized`: the runner chose `proposed` from the proposer's match length."""
        state = request.speculation
        if state is None:
            return
        method = self.method_of(request.params)
        if sized:
            self.sizing_methods.add(method)
            state.empty_in_a_row = 0
            state.empty_pause = _EMPTY_PAUSE
            if proposed:
                state.trimmed_in_a_row, state.trimmed_pause = 0, 1
                return
            state.trimmed_in_a_row += 1
            if state.trimmed_in_a_row >= _TRIMMED_LIMIT:  # asks again after the pause, pausing longer if trimmed again
                state.paused_for, state.probe_after_pause = state.trimmed_pause, False
                state.trimmed_pause = min(2 * state.trimmed_pause, _TRIMMED_PAUSE)
            return
        if proposed:
            self.sizing_methods.discard(method)  # this proposal came whole: today's estimate sizes them
        if proposed == 0:
            state.empty_in_a_row += 1
            if state.empty_in_a_row >= _EMPTY_LIMIT:  # a pause, not counted as a failure
                state.paused_for, state.empty_in_a_row, state.probe_after_pause = state.empty_pause, 0, False
                state.empty_pause = min(2 * state.empty_pause, self.config.cooldown_steps)
            return
        state.empty_in_a_row = 0
        state.empty_pause = _EMPTY_PAUSE
        state.accepted = _DECAY * state.accepted + accepted
        state.rejected = _DECAY * state.rejected + (1 if accepted < proposed else 0)
        if state.acceptance < self.config.min_acceptance:
            self._pause(state)
        elif accepted:
            state.backoff = 1

    def _pause(self, state: SpeculationState) -> None:
        state.paused_for = self.config.cooldown_steps * state.backoff
        state.probe_after_pause = True
        state.backoff = min(2 * state.backoff, _MAX_BACKOFF)
        state.empty_in_a_row = 0
        state.num_tokens = 1

