"""Structured outputs: the `structured_output` logits processor on llguidance, through the sampling
pipeline, the engine (`LLM`) and the OpenAI API (the official SDK against a real server)."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_fixtures import client, model, server  # noqa: F401 (fixtures)
from pydantic import BaseModel

from cadenza import LLM, SamplingParams
from cadenza.models.tokenizer import load_hf_tokenizer
from cadenza.samplers.base import SamplingBatch, SamplingContext
from cadenza.samplers.default_sampler import DefaultSampler
from cadenza.samplers.extra import RequestParamsError
from cadenza.samplers.pipeline import SamplingPipeline
from cadenza.samplers.structured import StructuredOutputProcessor, apply_bitmask
from cadenza.sampling_params import SamplingParamsError, StructuredOutputs

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                          "tag": {"enum": ["a", "b"]}},
         "required": ["x", "tag"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    path = tiny_model_dir("llama3")
    return load_hf_tokenizer(path, [2])


def make_pipeline(tokenizer, vocab_size: int = 320):
    context = SamplingContext(vocab_size=vocab_size, eos_token_ids=tokenizer.eos_token_ids, device=torch.device("cpu"),
                              tokenizer=tokenizer)  # fmt: skip
    processor = StructuredOutputProcessor(context)
    return SamplingPipeline(context, [processor], DefaultSampler(context)), processor


def run(pipeline, params, outputs, ids, steps=400, seed=0, eos=(2,), logits_fn=None):
    """Sample until every row emitted EOS (or `steps`); outputs are appended in place, as the runner does."""
    generator = torch.Generator().manual_seed(seed)
    done = [False] * len(params)
    for _ in range(steps):
        live = [i for i in range(len(params)) if not done[i]]
        if not live:
            break
        batch = SamplingBatch([params[i] for i in live], [[1]] * len(live), [outputs[i] for i in live], [None] * len(live),
                              [ids[i] for i in live])  # fmt: skip
        logits = logits_fn(len(live)) if logits_fn else torch.randn(len(live), pipeline.context.vocab_size, generator=generator)
        for i, token in zip(live, pipeline(logits, batch).token_ids.tolist()):
            outputs[i].append(token)
            done[i] = token in eos
    return outputs


def text_of(tokenizer, tokens):
    return tokenizer.decode([t for t in tokens if t != 2])


# --- the processor on its own -------------------------------------------------------------------


def test_every_constraint_kind_holds_at_temperature_one(tokenizer):
    pipeline, processor = make_pipeline(tokenizer)
    specs = [{"json": POINT}, {"regex": r"[0-9]{2,4}-(ab|cd)"}, {"choice": ["yes", "no", "maybe"]},
             {"grammar": 'start: "(" item ("," item)* ")"\nitem: "x" | "yy"'}, {"json_object": True}]  # fmt: skip
    params = [SamplingParams(structured_outputs=s) for s in specs]
    for p in params:
        pipeline.extra_params.prepare(p)
    outputs = run(pipeline, params, [[] for _ in params], [f"r{i}" for i in range(len(params))])
    assert all(o[-1] == 2 for o in outputs), "each grammar completed and then allowed only EOS"
    texts = [text_of(tokenizer, o) for o in outputs]
    jsonschema.validate(json.loads(texts[0]), POINT)
    assert re.fullmatch(r"[0-9]{2,4}-(ab|cd)", texts[1])
    assert texts[2] in ("yes", "no", "maybe")
    assert re.fullmatch(r"\((x|yy)(,(x|yy))*\)", texts[3])
    assert isinstance(json.loads(texts[4]), dict)
    pipeline.finish_requests([f"r{i}" for i in range(len(params))])
    assert processor.num_requests == 0 and pipeline.num_joined == 0


def test_free_rows_are_untouched_and_padded_ids_never_allowed(tokenizer):
    pipeline, _ = make_pipeline(tokenizer, vocab_size=352)  # the model pads its vocabulary past 320
    params = [SamplingParams(), SamplingParams(structured_outputs={"choice": ["yes"]}), SamplingParams()]
    logits = torch.randn(3, 352, generator=torch.Generator().manual_seed(1))
    logits[1, 320:] = 1e4  # the padded rows would win if they were not masked
    raw = logits.clone()
    batch = SamplingBatch(params, [[1]] * 3, [[], [], []], [None] * 3, ["f1", "c", "f2"])
    processor = pipeline.processors[0]
    pipeline.add_requests(batch)
    masked = processor.apply(logits, batch)
    assert torch.equal(masked[0], raw[0]) and torch.equal(masked[2], raw[2])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed and all(t < 320 for t in allowed)
    assert all(tokenizer.decode([t]) and "yes".startswith(tokenizer.decode([t])) for t in allowed)


def test_preemption_rolls_the_matcher_back_to_the_kept_tokens(tokenizer):
    pipeline, processor = make_pipeline(tokenizer)
    params = [SamplingParams(structured_outputs={"json": POINT})]
    output: list[int] = []
    run(pipeline, params, [output], ["p"], steps=6)
    consumed_before = len(output)
    del output[2:]  # the scheduler kept two tokens; the runner dropped those sampled in flight
    run(pipeline, params, [output], ["p"], seed=7)
    assert len(output) != consumed_before or output[-1] == 2
    jsonschema.validate(json.loads(text_of(tokenizer, output)), POINT)


def test_async_scheduling_catches_up_on_tokens_it_has_not_seen(tokenizer):
    """A step may see two new tokens at once (a failed step's rows resampled): it consumes both."""
    pipeline, _ = make_pipeline(tokenizer)
    params = [SamplingParams(structured_outputs={"regex": "abcabc"})]
    output = tokenizer.encode("abc", add_special_tokens=False)
    run(pipeline, params, [output], ["q"])
    assert text_of(tokenizer, output) == "abcabc" and output[-1] == 2


def test_a_token_the_grammar_refuses_fails_only_its_row(tokenizer):
    pipeline, _ = make_pipeline(tokenizer)
    params = [SamplingParams(structured_outputs={"choice": ["yes"]}), SamplingParams(structured_outputs={"choice": ["no"]})]
    bad = tokenizer.encode("zzz", add_special_tokens=False)
    batch = SamplingBatch(params, [[1]] * 2, [bad, []], [None] * 2, ["bad", "good"])
    with pytest.raises(Exception) as caught:
        pipeline(torch.randn(2, 320), batch)
    assert caught.value.rows == [0] and "does not allow the sampled token" in caught.value.message_for(0)


def test_grammars_compile_once_at_prepare_and_errors_name_the_field(tokenizer):
    pipeline, processor = make_pipeline(tokenizer)
    spec = SamplingParams(structured_outputs={"json": POINT})
    pipeline.extra_params.prepare(spec)
    compiled = processor.compiler.num_compiled
    same = SamplingParams(structured_outputs={"json": json.dumps(POINT)})  # JSON text is the same spec
    pipeline.extra_params.prepare(same)
    run(pipeline, [spec, same], [[], []], ["s1", "s2"], steps=3)
    assert processor.compiler.num_compiled == compiled
    for bad, message in [({"json": {"type": "foo"}}, "structured_outputs.json: Invalid type: foo"),
                         ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "structured_outputs.json: Unsatisfiable"),
                         ({"regex": "a(b"}, "structured_outputs.regex: "),
                         ({"grammar": "start: nope"}, 'structured_outputs.grammar: at 1(8): unknown name: "nope"')]:  # fmt: skip
        with pytest.raises(RequestParamsError, match=re.escape(message)):
            pipeline.extra_params.prepare(SamplingParams(structured_outputs=bad))


def test_a_deployment_without_the_processor_refuses_structured_requests(tokenizer):
    context = SamplingContext(vocab_size=320, eos_token_ids=(2,), device=torch.device("cpu"))
    pipeline = SamplingPipeline(context, [], DefaultSampler(context))
    with pytest.raises(RequestParamsError, match="add 'structured_output' to sampling.logits_processors"):
        pipeline.extra_params.prepare(SamplingParams(structured_outputs={"regex": "a"}))


@pytest.mark.parametrize("spec, message", [
    ({}, "give exactly one of json, json_object, regex, choice, grammar"),
    ({"regex": "a", "choice": ["a"]}, "got ['regex', 'choice']"),
    ({"json": "{nope"}, "structured_outputs.json: not valid JSON"),
    ({"choice": []}, "structured_outputs.choice"),
])  # fmt: skip
def test_the_spec_shape_is_checked_by_sampling_params(spec, message):
    with pytest.raises(SamplingParamsError, match=re.escape(message)):
        SamplingParams(structured_outputs=spec)
    with pytest.raises(SamplingParamsError, match="ignore_eos or min_tokens"):
        SamplingParams(structured_outputs={"regex": "a"}, ignore_eos=True)


def test_apply_bitmask_matches_a_reference_on_some_rows():
    logits = torch.randn(4, 70)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32)
    expected = logits.clone()
    for k, row in enumerate([1, 3]):
        for token in range(70):
            if not (int(bitmask[k, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_bitmask(logits, bitmask, [1, 3])
    assert torch.equal(logits, expected)


# --- through the engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(tiny_model_dir("llama3"), dtype="float32", max_num_seqs=16) as engine:
        yield engine


def test_a_mixed_batch_gives_free_requests_their_solo_tokens(llm):
    free = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)]  # fmt: skip
    prompts = ["The quick brown fox", "Paged attention"]
    solo = [llm.generate(p, s)[0].outputs[0].token_ids for p, s in zip(prompts, free)]
    constrained = SamplingParams(temperature=1.0, max_tokens=300, structured_outputs={"json": POINT})
    mixed = [o.outputs[0] for o in llm.generate([*prompts, "x", "y"], [*free, constrained, constrained])]
    assert [o.token_ids for o in mixed[:2]] == solo
    for out in mixed[2:]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), POINT)


def test_llm_reports_an_invalid_schema_by_field(llm):
    out = llm.generate("x", SamplingParams(structured_outputs={"json": {"type": "object", "required": 3}}))[0].outputs[0]
    assert out.finish_reason == "error" and out.error_code == "invalid_value"
    assert out.error.startswith("structured_outputs.json: ")


def _scalar():
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-1000, 1000), st.integers(0, 500)),
        st.builds(lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(1, 100)),
        st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=4, unique=True).map(lambda e: {"enum": e}),
        st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
    )  # fmt: skip


def _object(children):
    keys = st.lists(st.sampled_from(["id", "name", "items", "ok", "v"]), min_size=1, max_size=3, unique=True)

    def build(draw_keys):
        return st.tuples(st.just(draw_keys), st.lists(children, min_size=len(draw_keys), max_size=len(draw_keys)),
                         st.lists(st.booleans(), min_size=len(draw_keys), max_size=len(draw_keys)))  # fmt: skip

    def assemble(parts):
        names, values, required = parts
        return {"type": "object", "properties": dict(zip(names, values)),
                "required": [n for n, r in zip(names, required) if r], "additionalProperties": False}  # fmt: skip

    return keys.flatmap(build).map(assemble)


SCHEMAS = st.recursive(
    _scalar(),
    lambda children: st.one_of(
        _object(children),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)),
    ),
    max_leaves=6,
)


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schemas=st.lists(SCHEMAS, min_size=4, max_size=4), compact=st.booleans())
def test_generated_schemas_always_validate(llm, schemas, compact):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured_outputs={"json": s, "disable_any_whitespace": compact})
              for i, s in enumerate(schemas)]  # fmt: skip
    for schema, request in zip(schemas, llm.generate(["{"] * len(schemas), params)):
        out = request.outputs[0]
        assert out.finish_reason == "stop", (schema, out.text, out.error)
        jsonschema.validate(json.loads(out.text), schema)


# --- the OpenAI API -----------------------------------------------------------------------------


class Weather(BaseModel):
    city: Literal["Paris", "Tokyo"]
    celsius: int
    sunny: bool


def test_sdk_parse_returns_a_valid_object(client, model):
    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Weather?"}], response_format=Weather, max_tokens=400
    )
    (choice,) = completion.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Weather)


def test_json_mode_streamed_completions_and_guided_fields(client, model):
    chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=400,
                                            response_format={"type": "json_object"}, stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    done = client.completions.create(model=model, prompt="Answer:", max_tokens=50, extra_body={"guided_choice": ["yes", "no"]})
    assert done.choices[0].text in ("yes", "no")
    regex = client.completions.create(model=model, prompt="n", max_tokens=50, extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", regex.choices[0].text)
    vllm = client.completions.create(model=model, prompt="n", max_tokens=50,
                                     extra_body={"structured_outputs": {"grammar": 'start: "ab" | "cd"'}})  # fmt: skip
    assert vllm.choices[0].text in ("ab", "cd")


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema: Invalid type: foo"),
    ({"guided_regex": "a(b"}, "guided_regex", "guided_regex: "),
    ({"structured_outputs": {"json": {"type": "string", "format": "weird"}}}, "structured_outputs.json", "Unknown format: weird"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "give at most one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs json_schema.schema"),
])  # fmt: skip
def test_an_invalid_constraint_is_a_400_naming_it_and_the_server_serves_on(server, model, body, param, message):
    for stream in (False, True):
        response = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **body})  # fmt: skip
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"
    ok = httpx.post(server.url + "/v1/completions", timeout=30, json={"model": model, "prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200


def test_the_spec_key_ignores_how_the_schema_was_sent():
    as_text = StructuredOutputs(json=json.dumps({"b": 1, "a": 2}))
    as_object = StructuredOutputs(json_schema={"a": 2, "b": 1})
    assert as_text.key() == as_object.key()


def test_a_step_after_the_grammar_ended_sees_eos_and_a_preemption_can_drop_it(tokenizer):
    """Async scheduling may sample a finished request once more (EOS, the only token allowed)."""
    pipeline, processor = make_pipeline(tokenizer)
    params = [SamplingParams(structured_outputs={"choice": ["yes"]})]
    output = tokenizer.encode("yes", add_special_tokens=False) + [2]
    logits = torch.zeros(1, 320)
    for _ in range(2):
        token = pipeline(logits.clone(), SamplingBatch(params, [[1]], [output], [None], ["e"])).token_ids.item()
        assert token == 2
        output.append(token)
    yes = len(output) - 3
    for keep, then_eos in ((yes + 1, True), (yes, True), (1, False)):  # preempted back to fewer tokens
        del output[keep:]
        token = pipeline(logits.clone(), SamplingBatch(params, [[1]], [output], [None], ["e"])).token_ids.item()
        assert (token == 2) == then_eos
    assert processor.num_requests == 1
