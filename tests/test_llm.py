"""The offline `LLM` API on a tiny random model: prompt kinds, per-request params, stopping."""

import pytest

from cadenza import LLM, SamplingParams
from cadenza.llm import _completions
from cadenza.models.prompts import PromptError
from cadenza.sampling_params import SEED_MAX, SEED_MIN


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama3"), dtype="float32", block_size=8, num_blocks=256)


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_prompt_kinds(llm):
    text, ids, chat = llm.generate(
        ["hello world", [5, 6, 7, 8], [{"role": "user", "content": "hi"}]], greedy(4)
    )
    assert text.prompt == "hello world"
    assert text.prompt_token_ids == llm.tokenizer.encode("hello world")
    assert ids.prompt_token_ids == [5, 6, 7, 8] and ids.prompt is None
    assert chat.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for out in (text, ids, chat):
        assert len(out.token_ids) == 4 and out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert out.timings is not None and out.timings.e2e_seconds > 0 and out.index == 0


def test_vllm_style_prompt_dicts(llm):
    """vLLM's TextPrompt and TokensPrompt dicts, alone or in a list, are prompts like any other."""
    (alone,) = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, greedy(4))
    text, ids = llm.generate([{"prompt": "hello world"}, {"prompt_token_ids": [5, 6, 7, 8]}], greedy(4))
    assert alone.prompt_token_ids == ids.prompt_token_ids == [5, 6, 7, 8] and alone.token_ids == ids.token_ids
    assert text.prompt == "hello world" and text.prompt_token_ids == llm.tokenizer.encode("hello world")
    with pytest.raises(PromptError, match="'prompt' \\(text\\) or 'prompt_token_ids'"):
        llm.generate({"text": "hi"}, greedy(1))
    with pytest.raises(PromptError, match="text only"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": None}}, greedy(1))


def test_single_prompt_and_per_prompt_params(llm):
    (single,) = llm.generate([5, 6, 7], greedy(3))
    assert len(single.token_ids) == 3
    short, long = llm.generate(["a", "b"], [greedy(2), greedy(5)])
    assert (len(short.token_ids), len(long.token_ids)) == (2, 5)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [greedy(1), greedy(1)])


def test_batch_does_not_change_greedy_tokens(llm):
    prompts = [[3 + i] * (i * 7 + 1) for i in range(6)]
    together = llm.generate(prompts, greedy(12))
    for prompt, out in zip(prompts, together):
        assert llm.generate([prompt], greedy(12))[0].token_ids == out.token_ids


def test_seed_reproduces_independent_of_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["seeded"], params)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate(["other", "seeded", "more"], [others, params, others])[1].token_ids
    assert alone == mixed
    different = llm.generate(["seeded"], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True))
    assert different[0].token_ids != alone


def test_n_gives_n_completions_per_prompt(llm):
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    outs = llm.generate(["seeded", [5, 6, 7]], [sampled, greedy(4)])
    assert [(o.prompt, o.index) for o in outs] == [("seeded", 0), ("seeded", 1), ("seeded", 2), (None, 0)]
    assert len({o.request_id for o in outs}) == 4
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 3
    for i, out in enumerate(outs[:3]):  # completion i is the request of one with seed + i
        alone = sampled.model_copy(update={"n": 1, "seed": 7 + i})
        assert llm.generate(["seeded"], alone)[0].token_ids == out.token_ids
    unseeded = llm.generate([[5, 6, 7]], SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    assert [(o.index, len(o.token_ids)) for o in unseeded] == [(0, 4), (1, 4)]


def test_completion_seeds_wrap_within_the_seed_range():
    seeds = [p.seed for p in _completions(SamplingParams(n=3, seed=SEED_MAX - 1))]
    assert seeds == [SEED_MAX - 1, SEED_MAX, SEED_MIN]
    assert [p.seed for p in _completions(SamplingParams(n=2))] == [None, None]
    assert all(p.n == 1 for p in _completions(SamplingParams(n=2)))


def test_async_engine_refuses_n(llm):
    async def stream():
        async for _ in llm.engine.generate([5, 6, 7], SamplingParams(n=2)):
            pass

    with pytest.raises(ValueError, match=r"n=2.*LLM\.generate.*OpenAI API's n"):
        llm._portal.call(stream)


def test_stop_token_ids_and_eos(llm):
    first = llm.generate([[10, 11, 12]], greedy(8))[0].token_ids
    stopped = llm.generate([[10, 11, 12]], greedy(8, stop_token_ids=[first[2]]))[0]
    assert stopped.token_ids == first[:3] and stopped.finish_reason == "stop"
    eos = llm.tokenizer.eos_token_ids[0]
    forced = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0})
    out = llm.generate([[10, 11, 12]], forced)[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    held = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias={eos: 100.0})
    out = llm.generate([[10, 11, 12]], held)[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos


def test_stop_strings_truncate_text(llm):
    full = llm.generate(["abc"], greedy(16))[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    out = llm.generate(["abc"], greedy(16, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    kept = llm.generate(["abc"], greedy(16, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text.endswith(stop)


def test_logprobs(llm):
    out = llm.generate([[7, 8, 9]], greedy(3, logprobs=3))[0]
    assert len(out.logprobs) == 3
    for entry, token in zip(out.logprobs, out.token_ids):
        assert entry.token_id == token
        assert len(entry.top) == 3
        assert entry.top[0][0] == token  # greedy picks the most likely token
        assert entry.logprob == pytest.approx(entry.top[0][1])
        assert entry.logprob <= 0


def test_preemption_when_cache_is_small_gives_same_tokens(tiny_model_dir):
    path = tiny_model_dir("llama3")
    prompts = [[20 + i] * 12 for i in range(6)]
    roomy = LLM(path, dtype="float32", block_size=4, num_blocks=256).generate(prompts, greedy(30))
    # 6 sequences of 42 tokens need 66 blocks of 4; 24 blocks force preemption by recompute.
    tight = LLM(path, dtype="float32", block_size=4, num_blocks=24).generate(prompts, greedy(30))
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]


def test_bad_prompts_are_clear(llm):
    with pytest.raises(PromptError, match="empty"):
        llm.generate([""], greedy(1))
    with pytest.raises(PromptError, match="out of range"):
        llm.generate([[1, 2, 10**6]], greedy(1))
    with pytest.raises(PromptError, match="max_model_len"):
        llm.generate([[5] * 600], greedy(1))
    with pytest.raises(PromptError, match="role"):
        llm.generate([[{"role": "user"}]], greedy(1))


def test_max_tokens_capped_by_context(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama3"), dtype="float32", max_model_len=40, num_blocks=64)
    out = llm.generate([[5] * 30], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_unknown_keyword_is_a_type_error(tiny_model_dir):
    with pytest.raises(TypeError, match="blocksize"):
        LLM(tiny_model_dir("llama3"), blocksize=8)


def test_sampling_params_validation_names_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert SamplingParams(stop="x").stop == ["x"]


def test_keyword_arguments_reach_plugin_options_and_speculation():
    from cadenza.config import load_config
    from cadenza.llm import config_overrides

    dotted = config_overrides("m.gguf", {"plugin_options": {"ngram": {"min_n": 3}}, "num_blocks": 8,
                                         "speculative_config": {"method": "suffix", "num_tokens": 4}})  # fmt: skip
    config = load_config(None, overrides=dotted, env={})
    assert config.plugin_options == {"ngram": {"min_n": 3}} and config.cache.num_blocks == 8
    assert (config.speculative.method, config.speculative.num_tokens, config.model.path) == ("suffix", 4, "m.gguf")
    with pytest.raises(TypeError, match="plugin_options"):  # the message lists the known names
        config_overrides(None, {"plugin_option": {}})


def test_llm_keywords_and_cli_flags_come_from_one_table():
    from cadenza.config.flags import ALIASES, BY_FLAG, KEYWORDS, schema_field
    from cadenza.llm import config_overrides

    for alias in ALIASES:
        assert schema_field(alias.path).description  # every short name sets a key that exists
    assert {a.path for a in ALIASES if a.flag} == {f.path for f in BY_FLAG.values()}
    assert {a.path for a in ALIASES if a.keyword} == set(KEYWORDS.values())
    # Where both surfaces offer a key they call it the same, but for the one CLI name vLLM gave it.
    differ = [a.path for a in ALIASES if a.flag and a.keyword and a.flag[2:].replace("-", "_") != a.keyword]
    assert differ == ["cache.memory_budget"]
    dotted = config_overrides(None, {"kv_cache_dtype": "int8", "tensor_parallel_size": 2, "max_num_seqs": 4})
    assert dotted == {"cache.dtype": "int8", "parallel.tensor_parallel_size": 2, "scheduler.max_num_seqs": 4}
