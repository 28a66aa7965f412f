"""Plugin layer: built-ins, class, module and entry-point plugins, the allowlist, and every error."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import sys
import textwrap
from pathlib import Path

import pluggy
import pytest
import torch

from cadenza.attention_backends.base import AttentionBackend
from cadenza.attention_backends.eager import EagerBackend
from cadenza.plugins import hookspecs
from cadenza.plugins.errors import PluginError, UnknownNameError
from cadenza.plugins.hookspecs import hookimpl
from cadenza.policies.eviction import EvictionPolicy, LRUPolicy
from cadenza.runtime.registries import (
    ALLOWLIST_ENV,
    DEFAULT_PLUGINS,
    ENTRY_POINT_GROUP,
    Registries,
    Registry,
    collect_registries,
    load_registries,
    make_plugin_manager,
)
from cadenza.samplers.base import LogitsProcessor, Sampler, SamplerOutput

BUILTIN_BACKENDS = ["eager", "torch_sdpa", "triton", "xformers"]
BUILTIN_SAMPLERS = ["default"]
BUILTIN_PROCESSORS = ["logit_bias", "min_p", "min_tokens", "penalties", "structured_output", "temperature", "top_k_top_p"]
BUILTIN_POLICIES = ["fifo", "lfu", "lru"]


# --- plugin classes a third party might write -------------------------------------------------


class GreedySampler(Sampler):
    name = "greedy_test"

    def sample(self, logits, raw_logits, batch):
        return SamplerOutput(token_ids=logits.argmax(dim=-1))


class NegateProcessor(LogitsProcessor):
    name = "negate_test"

    def apply(self, logits, batch):
        return logits.neg_()


class MRUPolicy(LRUPolicy):
    name = "mru_test"


class MyBackend(EagerBackend):
    name = "my_backend_test"


class ThirdPartyPlugin:
    """A class-based plugin implementing every hook, as in simonw/llm's tests."""

    @hookimpl
    def register_attention_backends(self, register):
        register(MyBackend.name, MyBackend)

    @hookimpl
    def register_samplers(self, register):
        register(GreedySampler.name, GreedySampler)
        register(NegateProcessor.name, NegateProcessor)

    @hookimpl
    def register_eviction_policies(self, register):
        register(MRUPolicy.name, MRUPolicy)


def load(*plugins: object, **kwargs) -> Registries:
    """The registries with the built-ins and `plugins`, never looking at installed entry points."""
    return load_registries(entry_points=False, extra_plugins=plugins, **kwargs)


MODULE_PLUGIN_SOURCE = """
    from cadenza.policies.eviction import LRUPolicy
    from cadenza.plugins.hookspecs import hookimpl

    LOADS = []  # one entry per time the hook ran

    class TmpPolicy(LRUPolicy):
        name = {policy!r}

    @hookimpl
    def register_eviction_policies(register):
        LOADS.append(1)
        register(TmpPolicy.name, TmpPolicy)
"""


@pytest.fixture
def write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write `name.py` into a directory on sys.path; forget the imported module afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


def write_policy_module(write_module, name: str, policy: str) -> str:
    return write_module(name, MODULE_PLUGIN_SOURCE.format(policy=policy))


def fake_entry_points(monkeypatch: pytest.MonkeyPatch, *eps: importlib.metadata.EntryPoint) -> None:
    """Make the registry see exactly `eps` in its entry-point group."""

    def entry_points(**kwargs):
        assert kwargs == {"group": ENTRY_POINT_GROUP}
        return list(eps)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def entry_point(name: str, value: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


# --- built-ins ---------------------------------------------------------------------------------


def test_builtins_are_registered():
    registries = load_registries(entry_points=False)
    assert registries.attention_backends.names() == BUILTIN_BACKENDS
    assert registries.samplers.names() == BUILTIN_SAMPLERS
    assert registries.logits_processors.names() == BUILTIN_PROCESSORS
    assert registries.eviction_policies.names() == BUILTIN_POLICIES


def test_builtins_are_ordinary_plugins_and_name_their_module():
    registries = load_registries(entry_points=False)
    expected = {
        "cadenza.attention_backends.builtins": (registries.attention_backends, BUILTIN_BACKENDS),
        "cadenza.samplers.builtins": (registries.samplers, BUILTIN_SAMPLERS),
        "cadenza.policies.eviction": (registries.eviction_policies, BUILTIN_POLICIES),
        "cadenza.policies.context": (registries.context_policies, ["drop_oldest", "error"]),
        "cadenza.speculative.builtins": (registries.proposers, ["draft", "ngram", "suffix"]),
        "cadenza.kv_connectors.builtins": (registries.kv_connectors, ["nixl", "torch_distributed"]),
        "cadenza.parsers.builtins": (registries.tool_parsers, ["harmony", "hermes", "llama3_json", "mistral", "qwen3_coder"]),
    }
    assert set(expected) == set(DEFAULT_PLUGINS)
    for module, (registry, names) in expected.items():
        assert all(registry.source_of(name) == module for name in names)
    assert {registries.logits_processors.source_of(n) for n in BUILTIN_PROCESSORS} == {"cadenza.samplers.builtins"}
    assert set(DEFAULT_PLUGINS) <= set(registries.plugin_names)


def test_registered_classes_have_the_right_base_and_name():
    registries = load_registries(entry_points=False)
    for registry in (
        registries.attention_backends,
        registries.samplers,
        registries.logits_processors,
        registries.eviction_policies,
    ):
        for name in registry.names():
            cls = registry.get(name)
            assert issubclass(cls, registry.base)
            assert cls.name == name
            assert name in registry


def test_environment_allowlist_is_read_when_env_is_not_given(monkeypatch, write_module):
    module = write_policy_module(write_module, "cadenza_test_env_default", "env_default_test")
    monkeypatch.setenv(ALLOWLIST_ENV, "")
    assert "env_default_test" not in load_registries([module], entry_points=False).eviction_policies
    monkeypatch.setenv(ALLOWLIST_ENV, module)
    assert "env_default_test" in load_registries([module], entry_points=False).eviction_policies


# --- class-based plugins -----------------------------------------------------------------------


def test_class_plugin_adds_to_every_registry():
    registries = load(ThirdPartyPlugin())
    assert registries.samplers.get("greedy_test") is GreedySampler
    assert registries.logits_processors.get("negate_test") is NegateProcessor
    assert registries.eviction_policies.get("mru_test") is MRUPolicy
    assert registries.attention_backends.get("my_backend_test") is MyBackend
    assert registries.samplers.source_of("greedy_test") == "ThirdPartyPlugin"
    assert "ThirdPartyPlugin" in registries.plugin_names
    # Built-ins are still there beside the plugin's names.
    assert set(BUILTIN_POLICIES) < set(registries.eviction_policies.names())


def test_logits_processors_are_routed_by_base_class():
    registries = load(ThirdPartyPlugin())
    assert "negate_test" not in registries.samplers
    assert "greedy_test" not in registries.logits_processors


def test_plugin_manager_registered_in_a_fixture_style():
    """make_plugin_manager + collect_registries is what load_registries does, in two steps."""
    plugin = ThirdPartyPlugin()
    pm = make_plugin_manager(entry_points=False, extra_plugins=[plugin])
    try:
        assert pm.is_registered(plugin)
        registries = collect_registries(pm)
        assert "mru_test" in registries.eviction_policies
    finally:
        pm.unregister(plugin)
    assert "mru_test" not in collect_registries(pm).eviction_policies


# --- module plugins ----------------------------------------------------------------------------


def test_module_plugin_loads_by_name(write_module):
    module = write_policy_module(write_module, "cadenza_test_module_plugin", "tmp_module_test")
    registries = load_registries([module], entry_points=False)
    assert registries.eviction_policies.get("tmp_module_test").__module__ == module
    assert registries.eviction_policies.source_of("tmp_module_test") == module
    assert module in registries.plugin_names


def test_module_listed_twice_loads_once(write_module):
    module = write_policy_module(write_module, "cadenza_test_module_twice", "tmp_twice_test")
    registries = load_registries([module, module], entry_points=False)
    assert "tmp_twice_test" in registries.eviction_policies
    assert sys.modules[module].LOADS == [1]
    assert registries.plugin_names.count(module) == 1


def test_module_named_by_entry_point_and_config_loads_once(monkeypatch, write_module):
    module = write_policy_module(write_module, "cadenza_test_module_both", "tmp_both_test")
    fake_entry_points(monkeypatch, entry_point("both", module))
    registries = load_registries([module])
    assert "tmp_both_test" in registries.eviction_policies
    assert sys.modules[module].LOADS == [1]


# --- entry points and the allowlist ------------------------------------------------------------


def test_entry_point_naming_a_module_loads(monkeypatch, write_module):
    module = write_policy_module(write_module, "cadenza_test_ep_module", "ep_module_test")
    fake_entry_points(monkeypatch, entry_point("epmod", module))
    registries = load_registries()
    assert "ep_module_test" in registries.eviction_policies
    assert registries.eviction_policies.source_of("ep_module_test") == "entry point epmod"


def test_entry_point_naming_an_attribute_loads(monkeypatch, write_module):
    module = write_module(
        "cadenza_test_ep_attr",
        """
        from cadenza.policies.eviction import FIFOPolicy
        from cadenza.plugins.hookspecs import hookimpl

        class AttrPolicy(FIFOPolicy):
            name = "ep_attr_test"

        class Plugin:
            @hookimpl
            def register_eviction_policies(self, register):
                register(AttrPolicy.name, AttrPolicy)

        plugin = Plugin()
        """,
    )
    fake_entry_points(monkeypatch, entry_point("epattr", f"{module}:plugin"))
    assert "ep_attr_test" in load_registries().eviction_policies


def test_entry_points_false_skips_them(monkeypatch, write_module):
    module = write_policy_module(write_module, "cadenza_test_ep_skipped", "ep_skipped_test")
    fake_entry_points(monkeypatch, entry_point("skipped", module))
    assert "ep_skipped_test" not in load_registries(entry_points=False).eviction_policies


@pytest.mark.parametrize(
    ("allow", "loaded"),
    [
        (None, True),  # no allowlist: every installed plugin loads
        ("epallow", True),  # allowed by entry-point name
        ("other, epallow ,", True),  # comma-separated, spaces and empty parts ignored
        ("other", False),
        ("", False),  # empty: no third-party plugin loads
    ],
)
def test_allowlist_controls_entry_points(monkeypatch, write_module, allow, loaded):
    module = write_policy_module(write_module, "cadenza_test_ep_allow", "ep_allow_test")
    fake_entry_points(monkeypatch, entry_point("epallow", module))
    env = {} if allow is None else {ALLOWLIST_ENV: allow}
    registries = load_registries(env=env)
    assert ("ep_allow_test" in registries.eviction_policies) is loaded
    assert set(BUILTIN_POLICIES) <= set(registries.eviction_policies.names())  # built-ins always load
    assert set(BUILTIN_BACKENDS) <= set(registries.attention_backends.names())


def test_allowlist_accepts_the_entry_point_value(monkeypatch, write_module):
    module = write_policy_module(write_module, "cadenza_test_ep_value", "ep_value_test")
    fake_entry_points(monkeypatch, entry_point("epvalue", module))
    assert "ep_value_test" in load_registries(env={ALLOWLIST_ENV: module}).eviction_policies


def test_allowlist_also_restricts_configured_modules(write_module):
    module = write_policy_module(write_module, "cadenza_test_module_allow", "module_allow_test")
    assert "module_allow_test" not in load_registries([module], entry_points=False, env={ALLOWLIST_ENV: ""}).eviction_policies
    assert "module_allow_test" in load_registries([module], entry_points=False, env={ALLOWLIST_ENV: module}).eviction_policies


def test_disallowed_entry_point_is_not_even_loaded(monkeypatch):
    fake_entry_points(monkeypatch, entry_point("notallowed", "cadenza_test_no_such_module"))
    load_registries(env={ALLOWLIST_ENV: ""})  # would raise if it tried to load it


# --- errors ------------------------------------------------------------------------------------


def test_duplicate_name_names_both_sources():
    class DupPlugin:
        @hookimpl
        def register_eviction_policies(self, register):
            register("lru", MRUPolicy)

    with pytest.raises(PluginError) as info:
        load(DupPlugin())
    message = str(info.value)
    assert "'lru'" in message and "twice" in message
    assert "'cadenza.policies.eviction'" in message and "'DupPlugin'" in message


def test_two_plugins_registering_the_same_new_name_collide():
    class First:
        @hookimpl
        def register_samplers(self, register):
            register("shared_test", GreedySampler)

    class Second:
        @hookimpl
        def register_samplers(self, register):
            register("shared_test", GreedySampler)

    with pytest.raises(PluginError, match=r"'shared_test'.*'First'.*'Second'"):
        load(First(), Second())


def test_hook_that_raises_names_plugin_and_hook():
    class BoomPlugin:
        @hookimpl
        def register_attention_backends(self, register):
            raise RuntimeError("kaput")

    with pytest.raises(PluginError) as info:
        load(BoomPlugin())
    message = str(info.value)
    assert "'BoomPlugin'" in message and "register_attention_backends" in message and "kaput" in message
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    ("hook", "name", "factory", "kind"),
    [
        ("register_eviction_policies", "bad_policy", object, "eviction policy"),
        ("register_eviction_policies", "bad_policy", MRUPolicy(), "eviction policy"),  # an instance
        ("register_attention_backends", "bad_backend", MRUPolicy, "attention backend"),
        ("register_attention_backends", "bad_backend", lambda **kw: None, "attention backend"),
        ("register_samplers", "bad_sampler", MyBackend, "sampler"),
        ("register_samplers", "bad_sampler", GreedySampler(context=None), "sampler"),
    ],
)
def test_registering_the_wrong_kind_is_rejected(hook, name, factory, kind):
    plugin = type("WrongKindPlugin", (), {hook: hookimpl(lambda self, register: register(name, factory))})()
    with pytest.raises(PluginError) as info:
        load(plugin)
    message = str(info.value)
    assert "'WrongKindPlugin'" in message and f"{kind} {name!r}" in message and "not a subclass" in message


@pytest.mark.parametrize("name", ["", None, 3])
def test_invalid_name_is_rejected(name):
    class BadNamePlugin:
        @hookimpl
        def register_eviction_policies(self, register):
            register(name, MRUPolicy)

    with pytest.raises(PluginError, match="'BadNamePlugin'.*invalid name"):
        load(BadNamePlugin())


@pytest.mark.parametrize(
    ("attr", "name", "known"),
    [
        ("attention_backends", "flash_test", BUILTIN_BACKENDS),
        ("samplers", "beam_test", BUILTIN_SAMPLERS),
        ("logits_processors", "typical_test", BUILTIN_PROCESSORS),
        ("eviction_policies", "arc_test", BUILTIN_POLICIES),
    ],
)
def test_unknown_name_lists_known_names(attr, name, known):
    registry: Registry = getattr(load_registries(entry_points=False), attr)
    with pytest.raises(UnknownNameError) as info:
        registry.get(name)
    error = info.value
    assert isinstance(error, PluginError) and isinstance(error, LookupError)
    assert error.name == name and error.known == known
    assert repr(name) in str(error)
    assert all(k in str(error) for k in known)
    with pytest.raises(UnknownNameError):
        registry.source_of(name)


def test_unknown_attention_backend_message():
    with pytest.raises(UnknownNameError, match=r"unknown attention backend 'flash'.*torch_sdpa"):
        load_registries(entry_points=False).attention_backends.get("flash")


def test_missing_module_names_it():
    with pytest.raises(PluginError, match="'cadenza_test_no_such_module'.*failed to import"):
        load_registries(["cadenza_test_no_such_module"], entry_points=False)


def test_module_raising_on_import_names_it(write_module):
    module = write_module("cadenza_test_broken_module", "raise ImportError('needs foo')\n")
    with pytest.raises(PluginError, match="'cadenza_test_broken_module'.*needs foo"):
        load_registries([module], entry_points=False)


def test_entry_point_failing_to_load_names_it(monkeypatch, write_module):
    module = write_module("cadenza_test_ep_broken", "raise RuntimeError('broken at import')\n")
    fake_entry_points(monkeypatch, entry_point("epbroken", module))
    with pytest.raises(PluginError, match=r"entry point 'epbroken'.*broken at import"):
        load_registries()


def test_entry_point_naming_a_missing_attribute_names_it(monkeypatch, write_module):
    module = write_policy_module(write_module, "cadenza_test_ep_noattr", "ep_noattr_test")
    fake_entry_points(monkeypatch, entry_point("epnoattr", f"{module}:nope"))
    with pytest.raises(PluginError, match=r"entry point 'epnoattr'.*nope"):
        load_registries()


def test_misspelled_hook_argument_is_a_plugin_error():
    class TypoPlugin:
        @hookimpl
        def register_samplers(self, registr):
            registr("typo", GreedySampler)

    with pytest.raises(PluginError, match="(?s)'TypoPlugin'.*register_samplers.*registr") as info:
        load(TypoPlugin())
    assert isinstance(info.value.__cause__, pluggy.PluginValidationError)


def test_misspelled_hook_name_is_a_plugin_error():
    class TypoHookPlugin:
        @hookimpl
        def register_sampler(self, register):
            register(GreedySampler.name, GreedySampler)

    with pytest.raises(PluginError, match="register_sampler'.*TypoHookPlugin"):
        load(TypoHookPlugin())


def test_two_plugins_with_the_same_plugin_name_collide():
    with pytest.raises(PluginError, match="'ThirdPartyPlugin'"):
        load(ThirdPartyPlugin(), ThirdPartyPlugin())


# --- start-up only -----------------------------------------------------------------------------


def test_registries_hold_no_plugin_manager():
    registries = load(ThirdPartyPlugin())
    pluggy_types = (pluggy.PluginManager, pluggy.HookRelay, pluggy.HookCaller, pluggy.HookImpl)
    assert [f.name for f in dataclasses.fields(Registries)] == [
        "attention_backends",
        "samplers",
        "logits_processors",
        "eviction_policies",
        "context_policies",
        "context_providers",
        "proposers",
        "kv_connectors",
        "reasoning_parsers",
        "tool_parsers",
        "protocols",
        "plugin_names",
    ]
    assert all(isinstance(name, str) for name in registries.plugin_names)
    for field in dataclasses.fields(Registries)[:4]:
        registry = getattr(registries, field.name)
        assert isinstance(registry, Registry)
        for value in vars(registry).values():
            assert not isinstance(value, pluggy_types)
        for factory, source in registry._entries.values():
            assert isinstance(factory, type) and isinstance(source, str)


def test_names_resolve_after_the_plugin_manager_is_gone():
    plugin = ThirdPartyPlugin()
    pm = make_plugin_manager(entry_points=False, extra_plugins=[plugin])
    registries = collect_registries(pm)
    for _, registered in pm.list_name_plugin():
        pm.unregister(registered)

    class NoHooks:
        def __getattr__(self, name):
            raise AssertionError(f"pm.hook.{name} consulted after start-up")

    pm.hook = NoHooks()
    assert registries.samplers.get("greedy_test") is GreedySampler
    assert registries.eviction_policies.get("lru") is LRUPolicy
    assert registries.attention_backends.source_of("torch_sdpa") == "cadenza.attention_backends.builtins"


def test_hooks_run_once_per_load(write_module):
    module = write_policy_module(write_module, "cadenza_test_runs_once", "runs_once_test")
    registries = load_registries([module], entry_points=False)
    for _ in range(3):
        registries.eviction_policies.get("runs_once_test")
    assert sys.modules[module].LOADS == [1]


def test_a_registered_backend_and_policy_can_be_instantiated():
    registries = load(ThirdPartyPlugin())
    backend = registries.attention_backends.get("my_backend_test")(
        num_heads=2, num_kv_heads=1, head_dim=4, scale=0.5, block_size=4, device=torch.device("cpu")
    )
    assert isinstance(backend, AttentionBackend)
    assert isinstance(registries.eviction_policies.get("mru_test")(), EvictionPolicy)


# --- context policies and providers --------------------------------------------------------------


class ContextPluginsPlugin:
    """Registers a context policy and a context provider, as a session plugin package would."""

    @hookimpl
    def register_context_policies(self, register):
        from cadenza.policies.context import DropOldest

        class KeepNothing(DropOldest):
            name = "keep_nothing_test"

            async def fit(self, window):
                return []

        register(KeepNothing.name, KeepNothing)

    @hookimpl
    def register_context_providers(self, register):
        from cadenza.policies.context import ContextProvider

        class Clock(ContextProvider):
            name = "clock_test"

            async def provide(self, request):
                return [{"role": "system", "content": "It is noon."}]

        register(Clock.name, Clock)


def test_context_policies_and_providers_register_beside_the_builtins():
    from cadenza.policies.context import ContextPolicy, ContextProvider

    registries = load(ContextPluginsPlugin())
    assert registries.context_policies.names() == ["drop_oldest", "error", "keep_nothing_test"]
    assert registries.context_policies.source_of("drop_oldest") == "cadenza.policies.context"
    assert issubclass(registries.context_policies.get("keep_nothing_test"), ContextPolicy)
    assert issubclass(registries.context_providers.get("clock_test"), ContextProvider)
    with pytest.raises(UnknownNameError, match="drop_oldest"):
        registries.context_policies.get("drop_newest")


def test_a_context_provider_of_the_wrong_kind_fails_start_up():
    class Wrong:
        @hookimpl
        def register_context_providers(self, register):
            register("wrong_test", MRUPolicy)

    with pytest.raises(PluginError, match="context provider 'wrong_test'.*not a subclass of ContextProvider"):
        load(Wrong())


def test_proposers_register_beside_the_builtins_and_must_be_proposers():
    from cadenza.speculative.base import Proposer

    class Plugin:
        @hookimpl
        def register_proposers(self, register):
            class Echo(Proposer):
                name = "echo_test"

                def propose(self, requests):
                    return [list(r.token_ids[-r.num_tokens :]) for r in requests]

            register(Echo.name, Echo)

    registries = load(Plugin())
    assert registries.proposers.names() == ["draft", "echo_test", "ngram", "suffix"]
    assert registries.proposers.source_of("ngram") == "cadenza.speculative.builtins"
    with pytest.raises(UnknownNameError, match="suffix"):
        registries.proposers.get("medusa")

    class Wrong:
        @hookimpl
        def register_proposers(self, register):
            register("wrong_test", MRUPolicy)

    with pytest.raises(PluginError, match="proposer 'wrong_test'.*not a subclass of Proposer"):
        load(Wrong())


def test_kv_connectors_register_beside_the_builtins_and_must_be_connectors():
    from cadenza.kv_connectors.torch_distributed import TorchDistributedConnector

    class Plugin:
        @hookimpl
        def register_kv_connectors(self, register):
            class Loopback(TorchDistributedConnector):
                name = "loopback_test"

            register(Loopback.name, Loopback)

    registries = load(Plugin())
    assert registries.kv_connectors.names() == ["loopback_test", "nixl", "torch_distributed"]
    assert registries.kv_connectors.source_of("nixl") == "cadenza.kv_connectors.builtins"
    with pytest.raises(UnknownNameError, match="known KV connectors: loopback_test, nixl, torch_distributed"):
        registries.kv_connectors.get("mooncake")

    class Wrong:
        @hookimpl
        def register_kv_connectors(self, register):
            register("wrong_test", MRUPolicy)

    with pytest.raises(PluginError, match="KV connector 'wrong_test'.*not a subclass of KVConnector"):
        load(Wrong())


def test_reasoning_parsers_register_beside_the_builtins_and_must_be_parsers():
    from cadenza.parsers.reasoning import ThinkTagParser

    class Plugin:
        @hookimpl
        def register_reasoning_parsers(self, register):
            class Bracketed(ThinkTagParser):
                name, open_tag, close_tag = "bracketed_test", "[think]", "[/think]"

            register(Bracketed.name, Bracketed)

    registries = load(Plugin())
    assert registries.reasoning_parsers.names() == ["bracketed_test", "deepseek_r1", "gpt_oss", "harmony", "qwen3", "think"]
    assert registries.reasoning_parsers.source_of("qwen3") == "cadenza.parsers.builtins"
    parser = registries.reasoning_parsers.get("bracketed_test")()
    assert parser.split("[think]hm[/think] yes", None) == ("hm", "yes")
    with pytest.raises(UnknownNameError, match="known reasoning parsers: bracketed_test, deepseek_r1, gpt_oss, harmony, qwen3, think"):
        registries.reasoning_parsers.get("no_such")

    class Wrong:
        @hookimpl
        def register_reasoning_parsers(self, register):
            register("wrong_test", MRUPolicy)

    with pytest.raises(PluginError, match="reasoning parser 'wrong_test'.*not a subclass of ReasoningParser"):
        load(Wrong())


def test_tool_parsers_register_beside_the_builtins_and_must_be_parsers():
    from cadenza.parsers.tool_calls import HermesToolParser

    class Plugin:
        @hookimpl
        def register_tool_parsers(self, register):
            class Tagged(HermesToolParser):
                name, start, end = "tagged_test", "<call>", "</call>"

            register(Tagged.name, Tagged)

    registries = load(Plugin())
    assert registries.tool_parsers.names() == ["harmony", "hermes", "llama3_json", "mistral", "qwen3_coder", "tagged_test"]
    assert registries.tool_parsers.source_of("mistral") == "cadenza.parsers.builtins"
    parser = registries.tool_parsers.get("tagged_test")()
    content, calls = parser.parse('Sure.<call>{"name": "f", "arguments": {}}</call>')
    assert content == "Sure." and [c.name for c in calls] == ["f"]
    with pytest.raises(UnknownNameError, match="known tool parsers: harmony, hermes, llama3_json, mistral, qwen3_coder"):
        registries.tool_parsers.get("no_such")

    class Wrong:
        @hookimpl
        def register_tool_parsers(self, register):
            register("wrong_test", MRUPolicy)

    with pytest.raises(PluginError, match="tool parser 'wrong_test'.*not a subclass of ToolParser"):
        load(Wrong())


def test_protocols_register_by_name_and_the_app_checks_their_kind():
    """A protocol registers like any plugin; the registry keeps its source, and the app (which owns
    the Protocol contract, above this layer) refuses a class that is not one, naming the plugin."""
    from fastapi import APIRouter

    from cadenza.api.builtin_protocols import BUILTIN_PROTOCOLS
    from cadenza.api.protocols import Protocol, select_protocols

    class Echo(Protocol):
        name = "echo_registry_test"

        def router(self):
            return APIRouter()

    class Plugin:
        @hookimpl
        def register_protocols(self, register):
            register(Echo.name, Echo)

    registries = load(Plugin())
    assert registries.protocols.names() == ["echo_registry_test"]
    plugins = [(n, registries.protocols.get(n), registries.protocols.source_of(n)) for n in registries.protocols.names()]
    served = select_protocols(BUILTIN_PROTOCOLS, plugins, None)
    assert [p.name for p in served][-1] == "echo_registry_test" and "anthropic" in [p.name for p in served]

    class Wrong:
        @hookimpl
        def register_protocols(self, register):
            register("wrong_test", MRUPolicy)

    wrong = load(Wrong()).protocols
    with pytest.raises(PluginError, match="protocol 'wrong_test'.*not a subclass of Protocol"):
        select_protocols(BUILTIN_PROTOCOLS, [("wrong_test", wrong.get("wrong_test"), "Wrong")], None)


# --- meta: every hook is tested and documented ---------------------------------------------------


def hookspec_functions() -> dict[str, object]:
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    return {
        name: fn
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, marker)
    }


def test_hookspecs_are_found():
    assert set(hookspec_functions()) == {
        "register_attention_backends",
        "register_samplers",
        "register_eviction_policies",
        "register_context_policies",
        "register_context_providers",
        "register_proposers",
        "register_kv_connectors",
        "register_reasoning_parsers",
        "register_tool_parsers",
        "register_protocols",
    }


def test_every_hookspec_is_exercised_here():
    source = Path(__file__).read_text()
    meta_start = source.index("# --- meta:")
    exercised = source[:meta_start]  # names listed by the meta-tests themselves do not count
    missing = [name for name in hookspec_functions() if f"def {name}(" not in exercised]
    assert not missing, f"hooks without a test in {Path(__file__).name}: {missing}"


@pytest.mark.parametrize("name", sorted(hookspec_functions()))
def test_every_hookspec_has_a_one_line_docstring(name):
    doc = inspect.getdoc(hookspec_functions()[name])
    assert doc, f"hook {name} has no docstring"
    assert "\n" not in doc, f"hook {name}'s docstring spans several lines: {doc!r}"


@pytest.mark.parametrize("name", sorted(hookspec_functions()))
def test_every_hookspec_takes_a_register_callback(name):
    assert list(inspect.signature(hookspec_functions()[name]).parameters) == ["register"]
