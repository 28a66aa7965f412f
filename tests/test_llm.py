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
    for request in (text, ids, chat):
        (out,) = request.outputs
        assert len(out.token_ids) == 4 and out.finish_reason == "length" and out.stop_reason is None
        assert out.text == llm.tokenizer.decode(out.token_ids) and out.index == 0
        assert request.metrics is not None and request.metrics.e2e_seconds > 0 and request.finished


def test_vllm_style_prompt_dicts(llm):
    """vLLM's TextPrompt and TokensPrompt dicts, alone or in a list, are prompts like any other."""
    (alone,) = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, greedy(4))
    text, ids = llm.generate([{"prompt": "hello world"}, {"prompt_token_ids": [5, 6, 7, 8]}], greedy(4))
    assert alone.prompt_token_ids == ids.prompt_token_ids == [5, 6, 7, 8]
    assert alone.outputs[0].token_ids == ids.outputs[0].token_ids
    assert text.prompt == "hello world" and text.prompt_token_ids == llm.tokenizer.encode("hello world")
    with pytest.raises(PromptError, match="'prompt' \\(text\\) or 'prompt_token_ids'"):
        llm.generate({"text": "hi"}, greedy(1))
    with pytest.raises(PromptError, match="text only"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": None}}, greedy(1))


def test_single_prompt_and_per_prompt_params(llm):
    (single,) = llm.generate([5, 6, 7], greedy(3))
    assert len(single.outputs[0].token_ids) == 3
    short, long = llm.generate(["a", "b"], [greedy(2), greedy(5)])
    assert (len(short.outputs[0].token_ids), len(long.outputs[0].token_ids)) == (2, 5)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [greedy(1), greedy(1)])


def test_batch_does_not_change_greedy_tokens(llm):
    prompts = [[3 + i] * (i * 7 + 1) for i in range(6)]
    together = llm.generate(prompts, greedy(12))
    for prompt, out in zip(prompts, together):
        assert llm.generate([prompt], greedy(12))[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_seed_reproduces_independent_of_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["seeded"], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate(["other", "seeded", "more"], [others, params, others])[1].outputs[0].token_ids
    assert alone == mixed
    different = llm.generate(["seeded"], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone


def test_n_gives_n_completions_per_prompt(llm):
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    seeded, plain = llm.generate(["seeded", [5, 6, 7]], [sampled, greedy(4)])
    assert (seeded.prompt, plain.prompt) == ("seeded", None) and seeded.request_id != plain.request_id
    assert [o.index for o in seeded.outputs] == [0, 1, 2] and [o.index for o in plain.outputs] == [0]
    assert len({tuple(o.token_ids) for o in seeded.outputs}) == 3
    for i, out in enumerate(seeded.outputs):  # completion i is the request of one with seed + i
        alone = sampled.model_copy(update={"n": 1, "seed": 7 + i})
        assert llm.generate(["seeded"], alone)[0].outputs[0].token_ids == out.token_ids
    (unseeded,) = llm.generate([[5, 6, 7]], SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    assert [(o.index, len(o.token_ids)) for o in unseeded.outputs] == [(0, 4), (1, 4)]


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
    first = llm.generate([[10, 11, 12]], greedy(8))[0].outputs[0].token_ids
    stopped = llm.generate([[10, 11, 12]], greedy(8, stop_token_ids=[first[2]]))[0].outputs[0]
    assert stopped.token_ids == first[:3] and stopped.finish_reason == "stop"
    eos = llm.tokenizer.eos_token_ids[0]
    forced = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0})
    out = llm.generate([[10, 11, 12]], forced)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
    held = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias={eos: 100.0})
    out = llm.generate([[10, 11, 12]], held)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos


def test_stop_strings_truncate_text(llm):
    full = llm.generate(["abc"], greedy(16))[0].outputs[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    out = llm.generate(["abc"], greedy(16, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    kept = llm.generate(["abc"], greedy(16, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text.endswith(stop)


def test_logprobs(llm):
    out = llm.generate([[7, 8, 9]], greedy(3, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 3
    for position, token in zip(out.logprobs, out.token_ids):
        # vLLM's shape: token id -> Logprob, the sampled token first; greedy picks the most likely.
        assert next(iter(position)) == token and len(position) == 3
        assert position[token].rank == 1 and position[token].logprob <= 0
        assert position[token].decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)
        assert [p.rank for p in position.values()] == [1, 2, 3]
        assert list(position.values())[1].logprob <= position[token].logprob
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for p, t in zip(out.logprobs, out.token_ids)))
    assert llm.generate([[7, 8, 9]], greedy(3))[0].outputs[0].cumulative_logprob is None


def test_preemption_when_cache_is_small_gives_same_tokens(tiny_model_dir):
    path = tiny_model_dir("llama3")
    prompts = [[20 + i] * 12 for i in range(6)]
    roomy = LLM(path, dtype="float32", block_size=4, num_blocks=256).generate(prompts, greedy(30))
    # 6 sequences of 42 tokens need 66 blocks of 4; 24 blocks force preemption by recompute.
    tight = LLM(path, dtype="float32", block_size=4, num_blocks=24).generate(prompts, greedy(30))
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


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
    out = llm.generate([[5] * 30], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
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


# --- vLLM's offline API: its documented examples run unchanged but for the import ---------------

# vLLM's examples/offline_inference/basic/basic.py, as its documentation prints it, the model a
# path and the import cadenza's.
VLLM_BASIC = '''
from cadenza import LLM, SamplingParams

# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    # Create an LLM.
    llm = LLM(model=MODEL)
    # Generate texts from the prompts.
    # The output is a list of RequestOutput objects
    # that contain the prompt, generated text, and other information.
    outputs = llm.generate(prompts, sampling_params)
    # Print the outputs.
    print("\\nGenerated Outputs:\\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)
    return outputs


outputs = main()
'''

# vLLM's examples/offline_inference/basic/chat.py, its core as documented: one conversation,
# then a batch of them.
VLLM_CHAT = '''
from cadenza import LLM, SamplingParams

llm = LLM(model=MODEL)
sampling_params = SamplingParams(max_tokens=8, temperature=0.5)


def print_outputs(outputs):
    print("\\nGenerated Outputs:\\n" + "-" * 80)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\\n")
        print(f"Generated text: {generated_text!r}")
        print("-" * 80)


print("=" * 80)

conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
print_outputs(outputs)

# A chat template can be optionally supplied.
conversations = [conversation for _ in range(10)]

# We turn on tqdm progress bar to verify it's indeed running batch inference
outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
print_outputs(outputs)
'''


@pytest.mark.parametrize("example", [VLLM_BASIC, VLLM_CHAT], ids=["basic", "chat"])
def test_vllm_s_documented_offline_examples_run_unchanged(tiny_model_dir, capsys, example):
    namespace = {"MODEL": str(tiny_model_dir("llama3"))}
    exec(compile(example, "vllm_example.py", "exec"), namespace)  # noqa: S102 (the example, as documented)
    outputs = namespace["outputs"]
    printed = capsys.readouterr().out
    assert outputs and all(len(o.outputs) == 1 and o.outputs[0].finish_reason in ("stop", "length") for o in outputs)
    for output in outputs:
        assert repr(output.outputs[0].text) in printed and repr(output.prompt) in printed


def test_chat_renders_each_conversation_with_its_tools_and_template_kwargs(llm):
    conversation = [{"role": "user", "content": "weather?"}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    (plain,) = llm.chat(conversation, greedy(3))
    assert plain.prompt == "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n"
    assert plain.prompt_token_ids == llm.tokenizer.encode(plain.prompt)
    # The same conversation, batched with another, through generate: the same tokens.
    first, second = llm.chat([conversation, conversation + [{"role": "assistant", "content": "x"},
                                                            {"role": "user", "content": "y"}]], greedy(3))
    assert first.outputs[0].token_ids == plain.outputs[0].token_ids and second.prompt.endswith("y<|im_end|>\n<|im_start|>assistant\n")
    (with_tools,) = llm.chat(conversation, greedy(3), tools=[tool])
    assert with_tools.prompt == llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tools=[tool])


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_completion(llm):
    # The prompt computed once before, so that each run below reads it from the prefix cache alike.
    llm.generate(["stop here"], greedy(1))
    full = llm.generate(["stop here"], greedy(16))[0].outputs[0]
    stop = full.text[2:4]
    by_string = llm.generate(["stop here"], greedy(16, stop=["never-there", stop]))[0].outputs[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", stop)
    token = full.token_ids[3]
    by_token = llm.generate(["stop here"], greedy(16, stop_token_ids=[token]))[0].outputs[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", token)
    assert llm.generate(["stop here"], greedy(4))[0].outputs[0].stop_reason is None  # length


def test_continue_final_message_ends_the_prompt_inside_the_assistant_s_text(llm):
    """vLLM's continue_final_message (Anthropic's prefill): the model goes on from the last
    (assistant) message's text instead of answering it in a new turn."""
    from cadenza.models.prompts import ChatPrompt

    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}]
    (went_on,) = llm.generate(ChatPrompt(messages, continue_final_message=True, add_generation_prompt=False), greedy(2))
    assert went_on.prompt.endswith("<|im_start|>assistant\nOne, two,")
    (closed,) = llm.generate(ChatPrompt(messages[:1], add_generation_prompt=False), greedy(2))
    assert closed.prompt == "<|im_start|>user\nCount.<|im_end|>\n"
    with pytest.raises(PromptError, match="last message from the assistant"):
        llm.generate(ChatPrompt(messages[:1], continue_final_message=True), greedy(1))
