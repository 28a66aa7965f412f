"""Sampling layer: processors, the default sampler and the pipeline (CPU, seeded, fast)."""

from __future__ import annotations

import pytest
import torch

from cadenza.config.schema import DEFAULT_LOGITS_PROCESSORS
from cadenza.samplers import (
    LogitsProcessor,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    SamplingContext,
    SamplingPipeline,
    builtins,
)
from cadenza.samplers.default_sampler import DefaultSampler
from cadenza.samplers.logits_processors import (
    LogitBiasProcessor,
    MinPProcessor,
    MinTokensProcessor,
    TemperatureProcessor,
    TopKTopPProcessor,
)
from cadenza.samplers.penalties import PenaltiesProcessor
from cadenza.sampling_params import SamplingParams

EOS = 2
CPU = torch.device("cpu")
NEG_INF = float("-inf")

# A fixed distribution over 8 tokens, deliberately unsorted and without ties.
# Descending: 1 (.30), 5 (.20), 3 (.15), 6 (.12), 7 (.08), 4 (.07), 2 (.05), 0 (.03).
PROBS = torch.tensor([0.03, 0.30, 0.05, 0.15, 0.07, 0.20, 0.12, 0.08])
LOGITS = PROBS.log()
DRAWS = 50_000
# 50k draws: a frequency's standard deviation is at most 0.0022, so 0.01 is a 4.5-sigma margin
# (and the seed is fixed), while a wrong nucleus or a missing renormalization moves some token's
# frequency by 0.03 or more.
FREQ_TOLERANCE = 0.01


def make_context(vocab: int = 8) -> SamplingContext:
    return SamplingContext(vocab_size=vocab, eos_token_ids=(EOS,), device=CPU)


def make_batch(params, prompts=None, outputs=None, generators=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=params,
        prompt_token_ids=prompts or [[] for _ in range(n)],
        output_token_ids=outputs or [[] for _ in range(n)],
        generators=generators or [None] * n,
    )


def make_pipeline(vocab: int = 8, seed: int = 0, processors=None, sampler=None) -> SamplingPipeline:
    context = make_context(vocab)
    classes = processors if processors is not None else builtin_processor_classes()
    sampler = sampler or DefaultSampler(context, generator=torch.Generator().manual_seed(seed))
    return SamplingPipeline(context, [cls(context) for cls in classes], sampler)


def make_generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def builtin_processor_classes() -> list[type[LogitsProcessor]]:
    by_name = {cls.name: cls for cls in builtins.BUILTINS}
    return [by_name[name] for name in DEFAULT_LOGITS_PROCESSORS]


def draw(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = DRAWS) -> torch.Tensor:
    """n independent draws of one request's distribution, as n rows of one batch."""
    pipeline = make_pipeline(vocab=logits.shape[-1])
    return pipeline(logits.repeat(n, 1), make_batch([params] * n)).token_ids


def frequencies(tokens: torch.Tensor, vocab: int = 8) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def renormalized(keep: list[int]) -> torch.Tensor:
    expected = torch.zeros_like(PROBS)
    expected[keep] = PROBS[keep] / PROBS[keep].sum()
    return expected


# -- greedy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = make_pipeline(vocab=100)(logits.clone(), make_batch([SamplingParams(temperature=0)] * 16))
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_ignores_truncation_and_temperature():
    params = SamplingParams(temperature=0, top_k=1, top_p=0.1, min_p=0.9)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    out = make_pipeline(vocab=50)(logits.clone(), make_batch([params] * 4))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


# -- distributions and exclusion ------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, keep",
    [
        (SamplingParams(), [0, 1, 2, 3, 4, 5, 6, 7]),
        (SamplingParams(top_k=3), [1, 5, 3]),
        # Cumulative .30, .50, .65, .77: the fourth token is the first to reach 0.7.
        (SamplingParams(top_p=0.7), [1, 5, 3, 6]),
        # After top-k=5 the mass .85 renormalizes to .353, .588, .765: three tokens reach 0.7.
        (SamplingParams(top_k=5, top_p=0.7), [1, 5, 3]),
        # Threshold 0.3 * 0.30 = 0.09 drops 7 (.08) and everything below.
        (SamplingParams(min_p=0.3), [1, 5, 3, 6]),
    ],
    ids=["plain", "top_k", "top_p", "top_k_then_top_p", "min_p"],
)
def test_filtered_distribution(params, keep):
    tokens = draw(params)
    assert set(tokens.unique().tolist()) <= set(keep)
    diff = (frequencies(tokens) - renormalized(keep)).abs().max().item()
    assert diff < FREQ_TOLERANCE


def test_temperature_distribution():
    tokens = draw(SamplingParams(temperature=0.5))
    expected = torch.softmax(LOGITS / 0.5, dim=-1)
    assert (frequencies(tokens) - expected).abs().max().item() < FREQ_TOLERANCE


def test_exclusion_on_random_logits():
    """Many rows, each a different filter setting, each repeated: nothing escapes its filter."""
    vocab, repeats = 200, 1000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    probs = torch.softmax(logits, dim=-1)
    settings = [dict(top_k=k) for k in (1, 2, 10, 40)]
    settings += [dict(top_p=p) for p in (0.05, 0.3, 0.8, 0.95)]
    settings += [dict(min_p=m) for m in (0.05, 0.2, 0.6)]
    params = [SamplingParams(**s) for s in settings for _ in range(repeats)]
    tokens = make_pipeline(vocab=vocab)(logits.repeat(len(params), 1), make_batch(params)).token_ids

    order = probs.argsort(descending=True)
    for i, setting in enumerate(settings):
        emitted = set(tokens[i * repeats : (i + 1) * repeats].tolist())
        if "top_k" in setting:
            allowed = set(order[: setting["top_k"]].tolist())
        elif "top_p" in setting:
            before = probs[order].cumsum(0) - probs[order]  # mass strictly above each token
            allowed = set(order[before < setting["top_p"]].tolist())
        else:
            allowed = set((probs >= setting["min_p"] * probs.max()).nonzero().flatten().tolist())
        assert emitted <= allowed, setting


# -- agreement with transformers' warpers ---------------------------------------------------------


def _hf():
    return pytest.importorskip("transformers.generation.logits_process")


def _apply(processor_cls, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    processor = processor_cls(make_context(logits.shape[-1]))
    batch = make_batch(params)
    assert processor.is_active(batch)
    return processor.apply(logits.clone(), batch)


RANDOM_LOGITS = torch.randn(6, 500, generator=torch.Generator().manual_seed(4)) * 3


@pytest.mark.parametrize("top_k", [1, 5, 50, 499, 1000])
def test_top_k_matches_hf(top_k):
    hf = _hf().TopKLogitsWarper(top_k)(None, RANDOM_LOGITS.clone())
    ours = _apply(TopKTopPProcessor, RANDOM_LOGITS, [SamplingParams(top_k=top_k)] * 6)
    assert torch.equal(ours.isinf(), hf.isinf())


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.7, 0.9, 0.99])
def test_top_p_matches_hf(top_p):
    hf = _hf().TopPLogitsWarper(top_p)(None, RANDOM_LOGITS.clone())
    ours = _apply(TopKTopPProcessor, RANDOM_LOGITS, [SamplingParams(top_p=top_p)] * 6)
    assert torch.equal(ours.isinf(), hf.isinf())


@pytest.mark.parametrize("top_k, top_p", [(10, 0.5), (100, 0.9), (3, 0.99)])
def test_top_k_then_top_p_matches_hf(top_k, top_p):
    hf_module = _hf()
    hf = hf_module.TopKLogitsWarper(top_k)(None, RANDOM_LOGITS.clone())
    hf = hf_module.TopPLogitsWarper(top_p)(None, hf)
    ours = _apply(TopKTopPProcessor, RANDOM_LOGITS, [SamplingParams(top_k=top_k, top_p=top_p)] * 6)
    assert torch.equal(ours.isinf(), hf.isinf())


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_hf(min_p):
    hf = _hf().MinPLogitsWarper(min_p)(None, RANDOM_LOGITS.clone())
    ours = _apply(MinPProcessor, RANDOM_LOGITS, [SamplingParams(min_p=min_p)] * 6)
    assert torch.equal(ours.isinf(), hf.isinf())


@pytest.mark.parametrize("temperature", [0.3, 1.7])
def test_temperature_matches_hf(temperature):
    hf = _hf().TemperatureLogitsWarper(temperature)(None, RANDOM_LOGITS.clone())
    params = [SamplingParams(temperature=temperature)] * 6
    ours = _apply(TemperatureProcessor, RANDOM_LOGITS, params)
    assert torch.allclose(ours, hf)


def test_per_row_settings_match_hf_row_by_row():
    """One batch, a different setting per row (greedy and unfiltered rows too)."""
    hf = _hf()
    settings = [dict(top_k=7), dict(top_p=0.6), dict(top_k=40, top_p=0.8), dict()]
    settings += [dict(temperature=0), dict(top_k=3, temperature=0)]
    params = [SamplingParams(**s) for s in settings]
    ours = _apply(TopKTopPProcessor, RANDOM_LOGITS, params)
    for i, s in enumerate(settings):
        row = RANDOM_LOGITS[i : i + 1].clone()
        if s.get("temperature", 1.0) != 0:  # greedy rows are left untouched
            if "top_k" in s:
                row = hf.TopKLogitsWarper(s["top_k"])(None, row)
            if "top_p" in s:
                row = hf.TopPLogitsWarper(s["top_p"])(None, row)
        assert torch.equal(ours[i : i + 1].isinf(), row.isinf()), s


def test_top_k_only_rows_mixed_with_unfiltered_rows():
    params = [SamplingParams(top_k=4), SamplingParams(), SamplingParams(top_k=1)]
    ours = _apply(TopKTopPProcessor, RANDOM_LOGITS[:3], params)
    assert (~ours.isinf()).sum(dim=-1).tolist() == [4, 500, 1]


# -- seeds ----------------------------------------------------------------------------------------


def _seeded_run(rows: list[tuple[SamplingParams, int | None]], steps: int = 6) -> list[list[int]]:
    """Tokens per row over `steps` calls, each seeded row with a fresh generator of its seed."""
    vocab = 1000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    generators = [make_generator(seed) for _, seed in rows]
    batch = make_batch([p for p, _ in rows], generators=generators)
    pipeline = make_pipeline(vocab=vocab, seed=99)
    per_step = [pipeline(logits.repeat(len(rows), 1), batch).token_ids for _ in range(steps)]
    return torch.stack(per_step, dim=1).tolist()


def test_same_seed_same_tokens_wherever_the_row_sits():
    params = SamplingParams(temperature=0.9, top_k=200, seed=42)
    alone = _seeded_run([(params, 42)])[0]
    assert _seeded_run([(params, 42)])[0] == alone
    crowd = [
        (SamplingParams(), None),
        (SamplingParams(seed=7), 7),
        (params, 42),
        (SamplingParams(temperature=0), None),
        (SamplingParams(top_p=0.5), None),
    ]
    assert _seeded_run(crowd)[2] == alone
    assert _seeded_run([(params, 42)] + crowd)[0] == alone


def test_different_seeds_differ():
    params = SamplingParams(temperature=1.0)
    assert _seeded_run([(params, 1)])[0] != _seeded_run([(params, 2)])[0]


# -- penalties, bias, min_tokens ------------------------------------------------------------------


def reference_penalties(logits: torch.Tensor, p: SamplingParams, prompt, output) -> torch.Tensor:
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def test_penalties_match_reference():
    vocab = 20
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(6)) * 2
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(),  # untouched
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.5),
    ]
    prompts = [[1, 2, 3, 3], [4, 5], [6, 7, 7], [0, 9, 19]]
    outputs = [[3, 8, 8], [4, 4], [7, 7, 7, 11, 12], [19, 19, 5]]
    batch = make_batch(params, prompts, outputs)
    out = PenaltiesProcessor(make_context(vocab)).apply(logits.clone(), batch)
    for i in range(4):
        expected = reference_penalties(logits[i], params[i], prompts[i], outputs[i])
        assert torch.allclose(out[i], expected), i
    assert torch.equal(out[1], logits[1])


def test_penalties_inactive_without_penalties():
    batch = make_batch([SamplingParams(), SamplingParams(temperature=0)])
    assert not PenaltiesProcessor(make_context()).is_active(batch)


def test_logit_bias():
    logits = torch.zeros(2, 8)
    params = [SamplingParams(logit_bias={3: 5.0, 7: -100.0, 99: 1.0}), SamplingParams()]
    out = _apply(LogitBiasProcessor, logits, params)
    expected = torch.zeros(2, 8)
    expected[0, 3], expected[0, 7] = 5.0, -100.0
    assert torch.equal(out, expected)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_bans_eos_and_stop_ids_until_reached(ignore_eos):
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], ignore_eos=ignore_eos)
    logits = torch.zeros(8)
    logits[EOS], logits[5], logits[1] = 3.0, 2.0, 1.0  # EOS, then the stop id, lead
    pipeline = make_pipeline()
    chosen = []
    for n_out in range(5):
        batch = make_batch([params], outputs=[[1] * n_out])
        chosen.append(pipeline(logits.unsqueeze(0).clone(), batch).token_ids.item())
    assert chosen == [1, 1, 1, EOS, EOS]

    processor = MinTokensProcessor(make_context())
    batch = make_batch([params, SamplingParams()], outputs=[[1], []])
    out = processor.apply(torch.zeros(2, 8), batch)
    assert out[0].isinf().nonzero().flatten().tolist() == [EOS, 5]
    assert not out[1].isinf().any()
    assert not processor.is_active(make_batch([params], outputs=[[1, 1, 1]]))


# -- logprobs -------------------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits():
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(7))
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.5, logprobs=3),
        SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=0),
        SamplingParams(logit_bias={0: 50.0}),  # no logprobs asked, still gets the batch's K
    ]
    batch = make_batch(params, prompts=[[1, 2], [3], []], outputs=[[4], [5, 5], []])
    out = make_pipeline(vocab=vocab)(logits.clone(), batch)  # float32: processors edit in place

    assert out.token_ids[2].item() == 0  # the bias did reach the sampler
    chosen = raw_logprobs.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    assert torch.allclose(out.logprobs, chosen)
    top_ids, top_values = out.top_logprobs
    assert top_ids.shape == top_values.shape == (3, 3)
    expected_values, expected_ids = raw_logprobs.topk(3, dim=-1)
    assert torch.equal(top_ids, expected_ids)
    assert torch.allclose(top_values, expected_values)
    assert (top_values[:, :-1] >= top_values[:, 1:]).all()


def test_logprobs_zero_still_returns_chosen():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(8)).bfloat16()
    params = [SamplingParams(temperature=0, logprobs=0)] * 2
    out = make_pipeline(vocab=10)(logits, make_batch(params))
    expected = torch.log_softmax(logits.float(), dim=-1).gather(1, out.token_ids.unsqueeze(1))
    assert torch.allclose(out.logprobs, expected.squeeze(1))
    assert out.top_logprobs[0].shape == (2, 0)


# -- mixed batches and the pipeline ---------------------------------------------------------------


def test_mixed_batch_rows_match_their_solo_runs():
    vocab = 300
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(9)) * 2
    top_of_last = int(logits[3].argmax())
    rows = [
        (SamplingParams(temperature=0), None, [], [1, 2]),
        (SamplingParams(top_k=5), None, [], []),
        (SamplingParams(temperature=0.7, top_p=0.9, seed=3), 3, [], [7]),
        (SamplingParams(temperature=0, repetition_penalty=2.0), None, [top_of_last], []),
    ]

    def run(indices):
        batch = make_batch(
            [rows[i][0] for i in indices],
            prompts=[rows[i][2] for i in indices],
            outputs=[rows[i][3] for i in indices],
            generators=[make_generator(rows[i][1]) for i in indices],
        )
        pipeline = make_pipeline(vocab=vocab, seed=123)
        return pipeline(logits[indices].clone(), batch).token_ids.tolist()

    together = run([0, 1, 2, 3])
    for i in (0, 2, 3):
        assert together[i] == run([i])[0], i
    assert together[1] in logits[1].topk(5).indices.tolist()
    assert together[3] != top_of_last  # the repetition penalty moved the argmax


class Spy(LogitsProcessor):
    name = "spy"
    active = True

    def __init__(self, context):
        super().__init__(context)
        self.calls: list[str] = []

    def is_active(self, batch):
        self.calls.append("is_active")
        return self.active

    def apply(self, logits, batch):
        self.calls.append("apply")
        return logits


class InvariantSpy(Spy):
    name = "invariant_spy"
    argmax_invariant = True


class InactiveSpy(Spy):
    name = "inactive_spy"
    active = False


class SpySampler(DefaultSampler):
    def __init__(self, context):
        super().__init__(context)
        self.calls = 0

    def sample(self, logits, raw_logits, batch):
        self.calls += 1
        return super().sample(logits, raw_logits, batch)


def test_pipeline_skips_invariant_and_inactive_processors():
    context = make_context()
    invariant, plain, inactive = InvariantSpy(context), Spy(context), InactiveSpy(context)
    sampler = SpySampler(context)
    pipeline = SamplingPipeline(context, [invariant, plain, inactive], sampler)

    pipeline(LOGITS.repeat(2, 1), make_batch([SamplingParams(temperature=0)] * 2))
    assert invariant.calls == []
    assert plain.calls == ["is_active", "apply"]
    assert inactive.calls == ["is_active"]
    assert sampler.calls == 1

    pipeline(LOGITS.repeat(2, 1), make_batch([SamplingParams(temperature=0), SamplingParams()]))
    assert invariant.calls == ["is_active", "apply"]


def test_all_greedy_fast_path_skips_the_sampler():
    context = make_context()
    sampler = SpySampler(context)
    pipeline = SamplingPipeline(context, [InvariantSpy(context), InactiveSpy(context)], sampler)
    out = pipeline(LOGITS.repeat(3, 1), make_batch([SamplingParams(temperature=0)] * 3))
    assert out.token_ids.tolist() == [1, 1, 1] and sampler.calls == 0


def test_builtins_register_like_a_plugin():
    registered: dict[str, type] = {}
    builtins.register_samplers(register=lambda name, cls: registered.setdefault(name, cls))
    assert set(registered) == {*DEFAULT_LOGITS_PROCESSORS, "default"}
    for name, cls in registered.items():
        assert cls.name == name
        assert issubclass(cls, Sampler if name == "default" else LogitsProcessor)
    invariant = {n for n, c in registered.items() if getattr(c, "argmax_invariant", False)}
    assert invariant == {"temperature", "min_p", "top_k_top_p"}


def test_processors_inactive_for_default_params():
    batch = make_batch([SamplingParams(), SamplingParams(temperature=0)])
    for cls in builtin_processor_classes():
        assert not cls(make_context()).is_active(batch), cls.name
    assert isinstance(make_pipeline()(LOGITS.repeat(2, 1), batch), SamplerOutput)
