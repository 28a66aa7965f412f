"""The plugin contracts, one test per hook or member (`covers`), pipeline-level and synchronous.

Engine-level behaviour (requests joining and leaving, failures contained to their requests, options
from the config) is in test_plugin_engine.py; the meta-test at the bottom checks both files.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from plugin_contracts import contract_members, covers, hookspec_names
from pydantic import BaseModel, ConfigDict, Field

from cadenza.actors.cache_manager import KVCacheManager
from cadenza.actors.ingress import PromptValidator, RequestRejected
from cadenza.policies.eviction import LRUPolicy
from cadenza.samplers.base import LogitsProcessor, SamplingBatch, SamplingContext, SamplingError
from cadenza.samplers.default_sampler import DefaultSampler
from cadenza.samplers.extra import ExtraParams, ExtraParamsError
from cadenza.samplers.pipeline import SamplingPipeline
from cadenza.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 8
LOGITS = torch.tensor([0.0, 3.0, 1.0, 2.0, 0.5, 2.5, 1.5, 0.2])  # argmax 1, then 5, 3


class BoostParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token: int = Field(0, ge=0, lt=VOCAB)
    amount: float = Field(10.0, gt=0)


class BoostProcessor(LogitsProcessor):
    """Adds `amount` to `token`'s logit on the rows that switch it on; records every call."""

    name = "boost"
    params_model = BoostParams

    def __init__(self, context, options=None):
        super().__init__(context, options)
        self.calls: list[tuple] = []

    def on_request_added(self, request_id, params):
        self.calls.append(("added", request_id, params))
        super().on_request_added(request_id, params)

    def on_request_finished(self, request_id):
        self.calls.append(("finished", request_id))
        super().on_request_finished(request_id)

    def apply(self, logits, batch):
        self.calls.append(("apply", logits.shape[0]))
        for row, params in enumerate(self.params_for(batch)):
            if params is not None:
                logits[row, params.token] += params.amount
        return logits


def make_context() -> SamplingContext:
    return SamplingContext(vocab_size=VOCAB, eos_token_ids=(7,), device=CPU)


def make_batch(params, request_ids=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params, [[] for _ in range(n)], [[] for _ in range(n)], [None] * n, request_ids or [f"r{i}" for i in range(n)])


def make_pipeline(*processors, sampler=None) -> SamplingPipeline:
    context = make_context()
    return SamplingPipeline(context, [p(context) if isinstance(p, type) else p for p in processors], sampler or DefaultSampler(context))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


# --- per-request params --------------------------------------------------------------------------


@covers("SamplingComponent.params_model", "SamplingComponent.on_request_added", "SamplingComponent.params_for")
def test_params_are_validated_once_on_join_and_reach_the_plugin():
    boost = BoostProcessor(make_context())
    pipeline = make_pipeline(boost)
    batch = make_batch([greedy(extra={"boost": {"token": 2}}), greedy()], ["a", "b"])
    for _ in range(3):
        assert pipeline(LOGITS.repeat(2, 1), batch).token_ids.tolist() == [2, 1]
    added = [c for c in boost.calls if c[0] == "added"]
    assert added == [("added", "a", BoostParams(token=2))]  # once, as the validated model
    assert boost.params_for(batch) == [BoostParams(token=2), None]


@covers("SamplingComponent.params_model")
def test_extra_true_is_the_defaults_and_false_or_none_is_off():
    extra = ExtraParams({"boost": BoostProcessor})
    assert extra.validate({"boost": True}) == {"boost": BoostParams()}
    assert extra.validate({"boost": False}) == {} and extra.validate({"boost": None}) == {}
    assert extra.validate({"boost": BoostParams(token=3)}) == {"boost": BoostParams(token=3)}
    assert ExtraParams({"raw": LogitsProcessor}).validate({"raw": [1, 2]}) == {"raw": [1, 2]}  # no model


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"boost": {"token": 99}}, "extra.boost.token: Input should be less than 8"),
        ({"boost": {"amount": 0, "tokn": 1}}, "extra.boost.amount: Input should be greater than 0; extra.boost.tokn: Extra inputs"),
        ({"boost": "yes"}, "extra.boost: expected an object of parameters, true or false (got str)"),
        ({"bost": {}}, "extra.bost: no sampler or logits processor named 'bost' runs here; known: boost, default"),
        (["boost"], "extra: must be an object keyed by plugin name"),
    ],
)
def test_bad_extra_names_the_field(extra, message):
    with pytest.raises(ExtraParamsError) as info:
        ExtraParams({"boost": BoostProcessor, "default": DefaultSampler}).validate(extra)
    assert str(info.value).startswith(message)


def test_a_params_model_that_is_not_a_pydantic_model_fails_start_up():
    from cadenza.plugins.errors import PluginError
    from cadenza.plugins.hookspecs import hookimpl
    from cadenza.runtime.registries import load_registries

    class Sloppy(BoostProcessor):
        name = "sloppy"
        params_model = dict

    class SloppyPlugin:
        @hookimpl
        def register_samplers(self, register):
            register(Sloppy.name, Sloppy)

    with pytest.raises(PluginError, match="'SloppyPlugin' registered logits processor 'sloppy' whose params_model is <class 'dict'>"):
        load_registries(entry_points=False, extra_plugins=[SloppyPlugin()])


def test_ingress_rejects_bad_extra_with_invalid_extra():
    validator = PromptValidator(None, vocab_size=VOCAB, max_model_len=64, max_prompt_tokens=None, capacity_tokens=64,
                                extra_params=make_pipeline(BoostProcessor).extra_params)  # fmt: skip
    validator.check_extra(greedy(extra={"boost": {"token": 1}}))
    with pytest.raises(RequestRejected) as info:
        validator.check_extra(greedy(extra={"boost": {"token": -1}}))
    assert info.value.code == "invalid_extra" and str(info.value).startswith("extra.boost.token:")


class FieldProcessor(LogitsProcessor):
    """Switched on by a SamplingParams field rather than `extra`; its set-up runs at the ingress."""

    name = "field_processor"
    request_field = "structured_outputs"

    def __init__(self, context, options=None):
        super().__init__(context, options)
        self.prepared: list = []

    def prepare_request(self, params):
        if params.regex == "bad":
            raise ValueError("structured_outputs.regex: bad is not a regex here")
        self.prepared.append(params.regex)

    def apply(self, logits, batch):
        for row, params in enumerate(self.params_for(batch)):
            if params is not None:
                logits[row, len(params.regex)] += 100.0
        return logits


@covers("SamplingComponent.request_field", "SamplingComponent.prepare_request")
def test_a_field_switches_a_component_on_and_its_set_up_runs_at_the_ingress():
    processor = FieldProcessor(make_context())
    pipeline = make_pipeline(processor)
    validator = PromptValidator(None, vocab_size=VOCAB, max_model_len=64, max_prompt_tokens=None, capacity_tokens=64,
                                extra_params=pipeline.extra_params)  # fmt: skip
    on, off = greedy(structured_outputs={"regex": "abc"}), greedy()
    assert validator.needs_preparing(on) and not validator.needs_preparing(off)
    validator.prepare(on)
    assert processor.prepared == ["abc"]
    with pytest.raises(RequestRejected) as info:
        validator.prepare(greedy(structured_outputs={"regex": "bad"}))
    assert info.value.code == "invalid_value" and str(info.value).startswith("structured_outputs.regex:")
    assert pipeline(LOGITS.repeat(2, 1), make_batch([on, off], ["a", "b"])).token_ids.tolist() == [3, 1]
    assert pipeline.num_joined == 1 and processor.request_params["a"].regex == "abc"
    pipeline.finish_requests(["a", "b"])
    assert not processor.request_params and pipeline.num_joined == 0


# --- join and leave ------------------------------------------------------------------------------


class RaisingHooks(BoostProcessor):
    name = "raising_hooks"

    def on_request_added(self, request_id, params):
        if params.token == 7:
            raise ValueError("token 7 is cursed")
        super().on_request_added(request_id, params)

    def on_request_finished(self, request_id):
        raise RuntimeError("cannot let go")


@covers("SamplingComponent.on_request_finished")
def test_leaving_requests_are_told_once_and_their_state_goes():
    boost = BoostProcessor(make_context())
    pipeline = make_pipeline(boost)
    pipeline(LOGITS.repeat(2, 1), make_batch([greedy(extra={"boost": True}), greedy()], ["a", "b"]))
    assert pipeline.num_joined == 1  # requests without extra are never recorded
    pipeline.finish_requests(["a", "b", "never-seen"])
    assert ("finished", "a") in boost.calls and not boost.request_params and pipeline.num_joined == 0
    pipeline.finish_requests(["a"])
    assert boost.calls.count(("finished", "a")) == 1


def test_hook_failures_fail_only_their_request_and_never_on_leaving():
    hooks = RaisingHooks(make_context())
    pipeline = make_pipeline(hooks)
    batch = make_batch([greedy(extra={"raising_hooks": {"token": 7}}), greedy(extra={"raising_hooks": {"token": 2}}), greedy()])
    with pytest.raises(SamplingError) as info:
        pipeline(LOGITS.repeat(3, 1), batch)
    assert info.value.rows == [0]
    assert "logits processor 'raising_hooks' failed in on_request_added" in info.value.message_for(0)
    assert "token 7 is cursed" in info.value.message_for(0)
    pipeline.finish_requests(["r0", "r1", "r2"])  # raises inside the plugin; logged, not raised
    assert pipeline.num_joined == 0


# --- the per-step calls --------------------------------------------------------------------------


@covers("LogitsProcessor.is_active")
def test_a_processor_no_row_switched_on_costs_nothing():
    boost = BoostProcessor(make_context())
    sampler_calls = []

    class SpySampler(DefaultSampler):
        def sample(self, logits, raw_logits, batch):
            sampler_calls.append(1)
            return super().sample(logits, raw_logits, batch)

    pipeline = make_pipeline(boost, sampler=SpySampler(make_context()))
    batch = make_batch([greedy(), greedy()])
    assert not boost.is_active(batch)
    assert pipeline(LOGITS.repeat(2, 1), batch).token_ids.tolist() == [1, 1]
    assert boost.calls == [] and sampler_calls == []  # a bare argmax: neither plugin ran
    pipeline(LOGITS.repeat(2, 1), make_batch([greedy(), greedy(extra={"boost": True})]))
    assert boost.is_active(make_batch([greedy()], ["r1"])) and ("apply", 2) in boost.calls


@covers("LogitsProcessor.argmax_invariant")
def test_greedy_batches_skip_argmax_invariant_processors():
    class Invariant(BoostProcessor):
        name = "invariant"
        argmax_invariant = True

    invariant = Invariant(make_context())
    pipeline = make_pipeline(invariant)
    pipeline(LOGITS.repeat(1, 1), make_batch([greedy(extra={"invariant": True})]))
    assert not any(c[0] == "apply" for c in invariant.calls)
    pipeline(LOGITS.repeat(1, 1), make_batch([SamplingParams(extra={"invariant": True})], ["s"]))
    assert ("apply", 1) in invariant.calls


class OnePass:
    """A stand-in for kernels/triton/sampling.py: records each call, picks token 4 for every row."""

    row_key = staticmethod(lambda seed, position: (seed * 31 + position) & ((1 << 63) - 1))

    def __init__(self):
        self.calls = []

    def sample(self, logits, temperatures, keys):
        self.calls.append((temperatures.tolist(), keys.tolist()))
        return torch.full((logits.shape[0],), 4, dtype=torch.int64)


@covers("LogitsProcessor.folds_into_one_pass", "Sampler.folds_into_one_pass")
def test_only_components_whose_class_folds_let_the_one_pass_sampler_stand_in():
    from cadenza.samplers.logits_processors import TemperatureProcessor

    class Race(DefaultSampler):  # a subclass: it does not inherit the default's claim
        name = "race"

    one_pass = OnePass()
    pipeline = make_pipeline(TemperatureProcessor)
    pipeline.use_one_pass(one_pass)
    batch = make_batch([SamplingParams(temperature=0.5, seed=3), greedy(), SamplingParams(temperature=1.5)], ["a", "b", "c"])
    assert pipeline(LOGITS.repeat(3, 1), batch).token_ids.tolist() == [4, 4, 4]
    temperatures, keys = one_pass.calls[-1]
    assert temperatures == [0.5, 0.0, 1.5] and keys[0] == OnePass.row_key(3, 0)
    race = make_pipeline(TemperatureProcessor, sampler=Race(make_context()))
    boosted = make_pipeline(TemperatureProcessor, BoostProcessor)
    for other, extra in ((race, {}), (boosted, {"boost": True})):
        other.use_one_pass(one_pass)
        calls = len(one_pass.calls)
        other(LOGITS.repeat(2, 1), make_batch([SamplingParams(temperature=0.5, extra=extra), SamplingParams()], ["a", "b"]))
        assert len(one_pass.calls) == calls  # the torch path ran
    logprobs = make_batch([SamplingParams(temperature=0.5, logprobs=2)], ["a"])
    calls = len(one_pass.calls)
    pipeline(LOGITS.repeat(1, 1), logprobs)
    assert len(one_pass.calls) == calls  # log-probabilities come from the torch path


class WrongShape(BoostProcessor):
    name = "wrong_shape"

    def apply(self, logits, batch):
        return logits[:, :3]


@covers("LogitsProcessor.apply", "LogitsProcessor.rows_using")
def test_apply_runs_once_per_step_and_a_wrong_shape_blames_only_its_rows():
    boost = BoostProcessor(make_context())
    make_pipeline(boost)(LOGITS.repeat(3, 1), make_batch([greedy(extra={"boost": True})] * 3))
    assert [c for c in boost.calls if c[0] == "apply"] == [("apply", 3)]  # one call, whole batch
    wrong = WrongShape(make_context())
    batch = make_batch([greedy(), greedy(extra={"wrong_shape": True}), greedy()])
    with pytest.raises(SamplingError) as info:
        make_pipeline(wrong)(LOGITS.repeat(3, 1), batch)
    assert wrong.rows_using(batch) == info.value.rows == [1]
    assert "logits processor 'wrong_shape': returned (3, 3), expected (3, 8)" in str(info.value)


# --- eviction policies ---------------------------------------------------------------------------


class RecordingPolicy(LRUPolicy):
    name = "recording_test"

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def on_cached(self, block_id, position):
        self.calls.append(("cached", block_id, position))

    def on_release(self, block_id):
        self.calls.append(("release", block_id))
        super().on_release(block_id)

    def on_acquire(self, block_id):
        self.calls.append(("acquire", block_id))
        super().on_acquire(block_id)

    def pop_victim(self):
        victim = super().pop_victim()
        self.calls.append(("victim", victim))
        return victim


@covers("EvictionPolicy.on_cached")
def test_on_cached_gets_each_blocks_position_in_its_sequence():
    policy = RecordingPolicy()
    cache = KVCacheManager(num_blocks=8, block_size=2, policy=policy)
    first = tuple(range(10, 17))  # 7 tokens: 3 full blocks
    cache.admit("a", first, 7)
    cache.commit("a", first)
    cache.admit("b", first[:4] + (99, 98, 97), 7)  # shares the first two blocks
    cache.commit("b", (99, 98, 97))  # the tokens after its cached prefix
    cached = [c for c in policy.calls if c[0] == "cached"]
    table_a, table_b = cache.block_table("a"), cache.block_table("b")
    assert cached == [("cached", table_a[0], 0), ("cached", table_a[1], 1), ("cached", table_a[2], 2), ("cached", table_b[2], 2)]


@covers("EvictionPolicy.on_release", "EvictionPolicy.on_acquire", "EvictionPolicy.pop_victim", "EvictionPolicy.__len__")
def test_cache_manager_calls_the_policy_in_contract_order():
    policy = RecordingPolicy()
    cache = KVCacheManager(num_blocks=4, block_size=2, policy=policy)
    tokens = (1, 2, 3, 4, 5)
    cache.admit("a", tokens, 5)
    cache.commit("a", tokens)
    cache.free("a")  # tail first: both cached blocks become evictable
    table = [c[1] for c in policy.calls if c[0] == "cached"]
    assert [c for c in policy.calls if c[0] == "release"] == [("release", table[1]), ("release", table[0])]
    assert len(policy) == 2
    cache.admit("b", tokens, 5)  # a prefix hit on both blocks
    assert [c for c in policy.calls if c[0] == "acquire"] == [("acquire", table[0]), ("acquire", table[1])] and len(policy) == 0
    cache.free("b")
    cache.admit("c", (9, 9, 9, 9, 9, 9, 9, 9), 8)  # needs all four blocks: two evictions
    assert [c[1] for c in policy.calls if c[0] == "victim"] == [table[1], table[0]]  # LRU: released first
    cache.check_invariants()


@covers("EvictionPolicy.on_evict", "EvictionPolicy.name")
def test_on_evict_forgets_a_block_that_left_the_cache_otherwise():
    policy = LRUPolicy()
    for block in (3, 4):
        policy.on_cached(block, 0)
        policy.on_release(block)
    policy.on_evict(3)
    assert len(policy) == 1 and policy.pop_victim() == 4 and policy.name == "lru"


# --- KV connectors (prefill/decode disaggregation; engine-level tests in test_disaggregation.py) ---


@covers("register_kv_connectors")
def test_a_kv_connector_plugin_registers_and_moves_blocks_by_the_contract():
    from cadenza.kv_connectors.base import BlockTransfer, KVConnector
    from cadenza.kv_connectors.blocks import block_nbytes, cache_tensors, gather_blocks, scatter_blocks
    from cadenza.plugins.errors import PluginError
    from cadenza.plugins.hookspecs import hookimpl
    from cadenza.runtime.registries import load_registries

    wire: dict[int, torch.Tensor] = {}

    class InProcessConnector(KVConnector):
        """Both replicas in one process: the payload goes through a dict."""

        name = "in_process_test"

        def join(self, peers):
            self.tensors = cache_tensors(self.kv_caches)

        def send(self, transfer):
            wire[transfer.transfer_id] = gather_blocks(self.tensors, transfer.source_blocks)
            return wire[transfer.transfer_id].numel()

        def receive(self, transfer):
            payload = wire.pop(transfer.transfer_id)
            scatter_blocks(self.tensors, transfer.destination_blocks, payload)
            return payload.numel()

    class Plugin:
        @hookimpl
        def register_kv_connectors(self, register):
            register(InProcessConnector.name, InProcessConnector)

    class BadPlugin:
        @hookimpl
        def register_kv_connectors(self, register):
            register("not_a_connector", dict)

    registries = load_registries(entry_points=False, extra_plugins=[Plugin()])
    assert registries.kv_connectors.names() == ["in_process_test", "nixl", "torch_distributed"]
    cls = registries.kv_connectors.get("in_process_test")
    source = [torch.randn(2, 6, 4, 2, 8) for _ in range(2)]  # 2 layers, 6 blocks of 4 tokens
    target = [torch.zeros(2, 6, 4, 2, 8) for _ in range(2)]
    sender, receiver = (cls(c, block_size=4, device=CPU) for c in (source, target))
    sender.join(None)
    receiver.join(None)
    transfer = BlockTransfer(7, 0, 1, (1, 4), (5, 0))
    assert sender.send(transfer) == receiver.receive(transfer) == 2 * block_nbytes(cache_tensors(source))
    for src, dst in zip(source, target):
        assert torch.equal(dst[:, 5], src[:, 1]) and torch.equal(dst[:, 0], src[:, 4])
        assert not dst[:, 1:5].any()  # nothing else written
    with pytest.raises(PluginError, match="not a subclass of KVConnector"):
        load_registries(entry_points=False, extra_plugins=[BadPlugin()])


# --- reasoning parsers (served end to end in test_reasoning.py) ----------------------------------


@covers("register_reasoning_parsers", "ReasoningParser.name", "ReasoningParser.stream", "ReasoningParser.split",
        "ReasoningStream.feed", "ReasoningParser.forced_call_reasoning")
def test_a_reasoning_parser_plugin_written_from_the_contract_alone():
    """A format no built-in knows (reasoning on lines that start with '> '), written against the
    two abstract classes only: registered by its hook, it streams and splits by the contract."""
    from cadenza.parsers.reasoning import ReasoningDelta, ReasoningParser, ReasoningStream
    from cadenza.plugins.hookspecs import hookimpl
    from cadenza.runtime.registries import load_registries

    class QuotedStream(ReasoningStream):
        def __init__(self):
            self.pending = ""

        def feed(self, text, final):
            self.pending += text
            lines = self.pending.split("\n")
            self.pending = "" if final else lines.pop()  # a line is judged when it is whole
            reasoning = "".join(line[2:] + "\n" for line in lines if line.startswith("> "))
            content = "".join(line + "\n" for line in lines if not line.startswith("> "))
            return ReasoningDelta(reasoning, content)

    class QuotedParser(ReasoningParser):
        name = "quoted_test"

        def stream(self, prompt_text):
            return QuotedStream()

    class Plugin:
        @hookimpl
        def register_reasoning_parsers(self, register):
            register(QuotedParser.name, QuotedParser)

    parser = load_registries(entry_points=False, extra_plugins=[Plugin()]).reasoning_parsers.get("quoted_test")()
    text = "> first\n> second\nanswer\n"
    assert parser.split(text, None) == ("first\nsecond", "answer")
    stream = parser.stream(None)
    deltas = [stream.feed(piece, final=False) for piece in ("> fir", "st\n> sec", "ond\nans")] + [stream.feed("wer", final=True)]
    assert "".join(d.reasoning for d in deltas) == "first\nsecond\n"
    assert "".join(d.content for d in deltas) == "answer\n"
    assert deltas[0] == ReasoningDelta()  # half a line: nothing yet
    # By default a forced call comes first; a parser that says how its reasoning is written lets
    # the forcing grammar take it before the calls.
    assert parser.forced_call_reasoning(None, 64) is None

    import llguidance

    from cadenza.parsers.tool_calls import HermesToolParser, forcing_grammar

    class QuotedFirst(QuotedParser):
        def forced_call_reasoning(self, prompt_text, budget):
            return f'reasoning: reasoning_line*\nreasoning_line[max_tokens={budget}]: "> " /[^\\n]*/ "\\n"\n'

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    grammar = forcing_grammar(HermesToolParser().grammar(tools, False), QuotedFirst().forced_call_reasoning(None, 32))
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) == ""


# --- tool parsers (each built-in against its family's real template in test_tool_calls.py) --------


@covers("register_tool_parsers", "ToolParser.__init__", "ToolParser.name", "ToolParser.consume", "ToolParser.grammar",
        "ToolParser.parse", "ToolParser.parse_forced")
def test_a_tool_parser_plugin_written_from_the_contract_alone():
    """A format no built-in knows (`CALL name {json}` lines), written against `ToolParser` only:
    registered by its hook, it streams, parses, forces and reads a forced output cut short."""
    import json

    import llguidance

    from cadenza.parsers.tool_calls import Consumed, ToolCall, ToolCallStream, ToolParser
    from cadenza.plugins.hookspecs import hookimpl
    from cadenza.runtime.registries import load_registries

    class LineParser(ToolParser):
        name = "line_test"

        def consume(self, text, final):
            lines = text.split("\n")
            rest = "" if final else lines.pop()  # a line is judged when it is whole
            calls = [ToolCall(line.split(" ", 2)[1], line.split(" ", 2)[2]) for line in lines if line.startswith("CALL ")]
            content = "".join(line + "\n" for line in lines if not line.startswith("CALL "))
            return Consumed(content, calls, rest)

        def grammar(self, tools, parallel):
            names = " | ".join(json.dumps(t["function"]["name"]) for t in tools)
            return f'start: "CALL " name " " %json {{"type": "object"}}\nname: {names}\n'

        def parse_forced(self, text, names):
            _, name, arguments = (text.split(" ", 2) + ["", ""])[:3]
            return [ToolCall(name if name in names else "", arguments)]

    class Plugin:
        @hookimpl
        def register_tool_parsers(self, register):
            register(LineParser.name, LineParser)

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    parser = load_registries(entry_points=False, extra_plugins=[Plugin()]).tool_parsers.get("line_test")(tools)
    assert parser.tools == tools
    content, calls = parser.parse('hello\nCALL f {"a": 1}')
    assert content == "hello" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
    stream = ToolCallStream(parser)
    assert stream.feed("hel", final=False) == ("", [])
    text, got = stream.feed('lo\nCALL f {}', final=True)
    assert text == "hello\n" and [c.name for c in got] == ["f"]
    grammar = llguidance.LLMatcher.grammar_from_lark(parser.grammar(tools, parallel=False))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    assert parser.parse_forced('CALL f {"a": ', ["f"])[0].arguments == '{"a": '


@covers("FormatTokens.keeps_special_tokens", "FormatTokens.end_tokens")
def test_a_format_written_in_special_tokens_gets_them_and_stops_on_its_ends():
    """A parser whose markers are special tokens asks for them in its text and names the tokens
    its turns end on; the params of a request it reads (`format_params`, which the chat API
    applies) keep special tokens and stop on each end the vocabulary has. Others ask nothing."""
    from cadenza.parsers.markers import format_params
    from cadenza.parsers.reasoning import ReasoningParser, ThinkTagParser

    class BracketParser(ReasoningParser):
        name = "bracket_test"
        keeps_special_tokens = True
        end_tokens = ("<|done|>", "<|not_in_vocab|>")

        def stream(self, prompt_text):
            raise NotImplementedError

    vocab = {"<|done|>": 7}
    params = SamplingParams(stop_token_ids=[3])
    kept = format_params(params, [ThinkTagParser(), BracketParser()], vocab.get)
    assert kept.skip_special_tokens is False and kept.stop_token_ids == [3, 7]
    assert params.skip_special_tokens is True and params.stop_token_ids == [3]  # a copy
    assert format_params(params, [ThinkTagParser()], vocab.get) is params
    assert (ThinkTagParser.keeps_special_tokens, ThinkTagParser.end_tokens) == (False, ())


# --- meta: every hook and contract member has a test --------------------------------------------


def test_every_contract_member_and_hook_has_a_test():
    covered = set()
    for module_name in ("test_plugin_contract", "test_plugin_engine", "test_context_plugins", "test_speculative",
                        "test_protocol_plugins"):
        module = importlib.import_module(module_name)
        for test in vars(module).values():
            covered.update(getattr(test, "covers", ()))
    wanted = set(contract_members()) | set(hookspec_names())
    assert not wanted - covered, f"contract members without a test: {sorted(wanted - covered)}"
    assert not covered - wanted, f"tests cover names that are not contract members: {sorted(covered - wanted)}"
