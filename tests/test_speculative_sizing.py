"""Sizing guesses from the proposer's match length: the runner's acceptance table and choice of k,
the speculator trimming proposals (plain ones taken whole), the match lengths `ngram` and
`suffix` report, and the scheduler's policy for methods the runner sizes."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_speculative_units import finish, make_core, run_step

from cadenza.actors.messages import SampledToken
from cadenza.actors.request_state import Request
from cadenza.config.schema import SpeculativeConfig
from cadenza.sampling_params import SamplingParams
from cadenza.speculative.base import Proposal, ProposalRequest, Proposer
from cadenza.speculative.ngram import CONFIDENCE_LENGTH, copy_forward, ngram_lookup, ngram_match
from cadenza.speculative.policy import SpeculationPolicy
from cadenza.speculative.sizing import MAX_MATCH, GuessSizer, MatchAcceptance, best_length
from cadenza.speculative.speculator import Speculator
from cadenza.step import Speculation

# --- the acceptance table and the choice of k -----------------------------------------------------


def test_table_counts_each_guess_up_to_the_first_rejection_at_its_own_match_length():
    table = MatchAcceptance()
    assert table.probability(1) == pytest.approx(0.75)  # the prior
    table.record(3, 5, 2)  # match 3: guesses at 3 and 4 kept, the one at 5 rejected, 6 and 7 unjudged
    assert table.probability(3) > 0.75 and table.probability(4) > 0.75
    assert table.probability(5) < 0.75
    assert table.probability(6) == table.probability(7) == pytest.approx(0.75)
    for _ in range(50):
        table.record(MAX_MATCH + 5, 16, 16)  # long matches share the last row
    assert table.probability(MAX_MATCH) == table.probability(MAX_MATCH + 40) > 0.95


def test_best_length_follows_the_match_and_the_cost():
    table = MatchAcceptance()
    for _ in range(40):
        table.record(1, 1, 0)  # one-token matches: rejected
        table.record(12, 16, 16)  # long ones: kept through the guess
    compute_bound, cheap = (lambda k: 1 + 0.7 * k), (lambda k: 1 + 0.1 * k)  # noqa: E731
    assert best_length(table, 1, 16, compute_bound) == best_length(table, 1, 16, cheap) == 0  # not one guess
    assert best_length(table, 12, 16, cheap) == 16  # nearly sure: all of it
    assert 0 < best_length(table, 12, 16, compute_bound) < 16
    assert best_length(table, 12, 5, cheap) == 5  # never more than the proposal
    # A middling row: a few guesses pay where rows are cheap, none where they cost a whole step.
    middling = MatchAcceptance()
    assert best_length(middling, 2, 16, lambda k: 1 + 0.05 * k) > 4
    assert best_length(middling, 2, 16, lambda k: 1 + 1.0 * k) == 0


def test_sizer_keeps_a_table_per_key_and_honours_a_pinned_token_cost():
    sizer = GuessSizer(token_cost=0.05)
    for _ in range(40):
        sizer.record(("ngram", False), 2, 4, 0)  # sampled requests: nothing kept
    assert sizer.size(("ngram", False), 2, 8, 1) == 0
    assert sizer.size(("ngram", True), 2, 8, 1) > 2  # greedy: the prior, cheap rows
    measured = GuessSizer()
    for _ in range(4):
        for rows in (1, 2, 5, 9):
            measured.observe_step(rows, 0.004 * rows)  # every row as dear as a one-row step
    assert measured.size(("ngram", True), 2, 8, 1) == 0


# --- the speculator ------------------------------------------------------------------------------


class FixedProposer(Proposer):
    name = "fixed"

    def __init__(self, reply):
        super().__init__(None)
        self.reply = reply

    def propose(self, requests):
        return [self.reply for _ in requests]


def test_speculator_trims_sized_proposals_and_takes_plain_ones_whole():
    proposers = {
        "sized": FixedProposer(Proposal([5, 6, 7, 8], 1)),
        "plain": FixedProposer([5, 6, 7, 8]),
        "unsure": FixedProposer(Proposal([5, 6, 7, 8], None)),
    }
    speculator = Speculator(proposers, "none", vocab_size=100, token_cost=0.2)
    for _ in range(40):
        speculator.sizer.record(("sized", True), 1, 4, 0)  # one-token matches never kept
    wanted = [("a", "sized", [1, 2], 4, True), ("b", "plain", [1, 2], 4, True), ("c", "unsure", [1, 2], 3, True)]
    guesses = speculator.propose(wanted, num_rows=3)
    assert guesses == {"b": [5, 6, 7, 8], "c": [5, 6, 7]}  # "a" trimmed to nothing
    assert speculator.sized == {"a": (("sized", True), 1, None)}
    # Verification teaches the table: a sized proposal's outcome, nothing for the others.
    speculator.proposers["sized"].reply = Proposal([5, 6], 20)
    assert speculator.propose([("a", "sized", [1, 2], 4, True)]) == {"a": [5, 6]}
    before = speculator.sizer.tables[("sized", True)].probability(20)
    speculator.learn([Speculation("a", "sized", 2, 2, True), Speculation("b", "plain", 4, 0)])
    assert speculator.sizer.tables[("sized", True)].probability(20) > before
    assert set(speculator.sizer.tables) == {("sized", True)}


def test_a_malformed_answer_loses_its_own_guess_and_nothing_else():
    class Odd(Proposer):
        name = "odd"

        def propose(self, requests):
            replies = {"none": None, "no-ids": Proposal(None, 2), "float-length": Proposal([5, 6], 2.5),
                       "generator": Proposal([5, 6], 3, (flag for flag in (True, False))), "numpy": np.array([7, 8]),
                       "good": Proposal([5, 6, 7], 2, [True, True, True])}  # fmt: skip
            return [replies[r.request_id] for r in requests]

    speculator = Speculator({"odd": Odd(None)}, "none", vocab_size=100, token_cost=0.0)
    names = ["none", "no-ids", "float-length", "generator", "numpy", "good"]
    guesses = speculator.propose([(name, "odd", [1, 2], 3, True) for name in names])
    assert guesses["good"] == [5, 6, 7] and guesses["numpy"] == [7, 8]
    assert guesses["generator"][:1] == [5] and speculator.sized["generator"][2] == (True, False)
    assert not {"none", "no-ids", "float-length"} & set(guesses)


# --- the proposers' match lengths ----------------------------------------------------------------


def test_ngram_match_length_follows_the_chosen_occurrence_back_past_max_n():
    def matched(tokens, end):  # how far the occurrence ending at `end` matches the suffix, backwards
        n = 0
        while end - n >= 0 and tokens[end - n] == tokens[len(tokens) - 1 - n]:
            n += 1
        return n

    rng = random.Random(7)
    for trial in range(300):
        base = [rng.randrange(3 if trial % 2 else 9) for _ in range(rng.randint(2, 50))]
        tokens = base + base[: rng.randint(0, len(base))]  # a copy in progress, often
        min_n, max_n = rng.randint(1, 3), 4
        guess, length, agreed = ngram_match(np.asarray(tokens), min_n, max_n, 5)
        ends = [e for e in range(len(tokens) - 1) if tokens[e] == tokens[-1]]
        best = max((min(matched(tokens, e), max_n) for e in ends), default=0)
        if best < min_n:
            assert guess == [] and length == best and agreed == []
            continue
        chosen = max(e for e in ends if min(matched(tokens, e), max_n) == best)  # the latest longest
        assert guess == copy_forward(tokens, chosen + 1, 5) == ngram_lookup(np.asarray(tokens), min_n, max_n, 5)
        assert length == min(matched(tokens, chosen), CONFIDENCE_LENGTH), tokens
        # Agreement, by brute force: the longest matches' occurrences that continued as the guess
        # so far (and have a next token) all continue with the guessed one.
        occurrences = [e for e in ends if min(matched(tokens, e), max_n) == best]
        expected = []
        for j, token in enumerate(guess):
            live = [e for e in occurrences if e + 1 + j < len(tokens) and tokens[e + 1 : e + 1 + j] == guess[:j]]
            expected.append(all(tokens[e + 1 + j] == token for e in live))
        assert agreed == expected, tokens


def test_proposers_report_their_match_lengths():
    from cadenza.speculative.ngram import NgramProposer
    from cadenza.speculative.suffix import SuffixProposer

    passage = list(range(10, 50))
    tokens = [*passage, 7, *passage[:20]]  # a copy 20 tokens in
    (ngram,) = NgramProposer(None).propose([ProposalRequest("a", tokens, 4)])
    (suffix,) = SuffixProposer(None).propose([ProposalRequest("a", tokens, 4)])
    assert ngram == suffix == Proposal([30, 31, 32, 33], 20, [True] * 4)  # one earlier occurrence: no split
    (far,) = NgramProposer(None).propose([ProposalRequest("a", [*passage, 7, *passage], 2)])
    assert far.match_length == CONFIDENCE_LENGTH  # judged no further back than the table's rows


def test_proposers_say_where_the_earlier_occurrences_split():
    from cadenza.speculative.ngram import NgramProposer
    from cadenza.speculative.suffix import SuffixProposer

    tokens = [1, 2, 5, 9, 1, 2, 6, 9, 3, 1, 2]  # "1 2" was followed by 5 once and by 6 once, then by 9 both times
    (ngram,) = NgramProposer(None).propose([ProposalRequest("a", tokens, 3)])
    (suffix,) = SuffixProposer(None).propose([ProposalRequest("a", tokens, 3)])
    assert ngram == Proposal([6, 9, 3], 2, [False, True, True])  # the latest occurrence's guess
    assert suffix == Proposal([5, 9, 1], 2, [False, True, True])  # the first occurrence's


def test_guesses_on_which_the_occurrences_split_are_sized_apart():
    table = MatchAcceptance()
    for _ in range(50):
        table.record(2, 4, 0, agreed=[False, True, True, True])  # split: never kept
        table.record(2, 4, 4, agreed=[True] * 4)  # agreed: always
    assert table.probability(2, agreed=False) < 0.1 < 0.9 < table.probability(2, agreed=True)
    cheap = lambda k: 1 + 0.1 * k  # noqa: E731
    assert best_length(table, 2, 4, cheap, agreed=[False, True, True, True]) == 0
    assert best_length(table, 2, 4, cheap, agreed=[True] * 4) == 4
    assert best_length(table, 2, 4, cheap) == 4  # a proposer that does not say counts as agreed


# --- the scheduler's policy ----------------------------------------------------------------------


def make_policy(**config) -> tuple[SpeculationPolicy, Request]:
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram", num_tokens=8, token_cost=0.3, **config))
    return policy, Request("a", (1,), SamplingParams(), 100, 0.0)


def test_a_method_the_runner_sizes_gets_its_whole_cap_and_no_acceptance_pause():
    policy, request = make_policy(min_acceptance=0.5)
    first = policy.num_tokens(request, 1, 20)
    assert 0 < first < 8  # today's estimate until the runner says it sizes this method
    policy.record(request, 3, 0, sized=True)
    assert policy.sizing_methods == {"ngram"}
    for _ in range(6):  # rejections: the runner's table learns them, the request is not paused
        assert policy.num_tokens(request, 1, 20) == 8
        policy.record(request, 2, 0, sized=True)
    assert policy.num_tokens(request, 1, 5) == 5  # room permitting
    assert policy.num_tokens(request, 5, 20) == 0  # still none over max_batch_size
    assert policy.cap(SamplingParams(logprobs=1)) == 0
    other = Request("b", (1,), SamplingParams(speculative={"method": "suffix"}), 100, 0.0)
    assert 0 < policy.num_tokens(other, 1, 20) < 8  # another method keeps today's estimate
    policy.record(request, 4, 1)  # a whole proposal of this method: back to today's estimate
    assert policy.sizing_methods == set()


def test_trimmed_to_nothing_is_neither_empty_nor_rejected_and_asks_less_often():
    policy, request = make_policy()
    policy.num_tokens(request, 1, 20)
    acceptance = request.speculation.acceptance
    for _ in range(3):
        policy.record(request, 0, 0, sized=True)
        assert policy.num_tokens(request, 1, 20) == 8  # still asking every decode
    assert request.speculation.acceptance == acceptance and request.speculation.empty_in_a_row == 0
    pauses = []
    for _ in range(4):  # trimmed again and again: skip 1 decode, then 2, then 4 at most
        policy.record(request, 0, 0, sized=True)
        asked = [policy.num_tokens(request, 1, 20) for _ in range(6)]
        pauses.append(asked.index(8))
    assert pauses == [1, 2, 4, 4]
    assert request.speculation.backoff == 1  # no acceptance pause's backoff either
    policy.record(request, 3, 1, sized=True)  # a guess verified: asking every decode again
    for _ in range(3):
        policy.record(request, 0, 0, sized=True)
        assert policy.num_tokens(request, 1, 20) == 8


def test_scheduler_reserves_the_cap_for_sized_requests_and_rolls_back():
    core, manager = make_core()
    request = Request("a", tuple(range(10, 16)), SamplingParams(max_tokens=30), 30, 0.0)
    core.add(request)
    plan, _ = run_step(core, manager)
    finish(core, manager, plan, [SampledToken("a", 100)])
    plan, (chunk,) = run_step(core, manager)
    # The runner trimmed the guesses to nothing: one token back, and the next step gets the cap.
    finish(core, manager, plan, [SampledToken("a", 101)], [Speculation("a", "ngram", 0, 0, sized=True)])
    plan, (chunk,) = run_step(core, manager)
    assert chunk.num_speculative == 4 and request.num_draft_slots == 4
    finish(core, manager, plan, [SampledToken("a", t) for t in (102, 103)], [Speculation("a", "ngram", 3, 1, sized=True)])
    assert request.num_computed_tokens == 9 and request.num_draft_slots == 0
    plan, (chunk,) = run_step(core, manager)
    assert chunk.num_speculative == 4  # a rejection does not shrink it: the runner sizes it
    manager.check_invariants()
