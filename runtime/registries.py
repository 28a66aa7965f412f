"""Load plugins once at start-up and resolve their names into registries.

Built-ins are ordinary plugins listed in `DEFAULT_PLUGINS`; third-party plugins come from the
entry-point group `cadenza` and from module names in the deployment config. `CADENZA_PLUGINS`
(comma-separated entry-point names or module names) restricts which third-party plugins load;
set it to an empty string to load none.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, Mapping, TypeVar

import pluggy

from cadenza.config import environment
from cadenza.plugins import hookspecs
from cadenza.plugins.errors import PluginError, UnknownNameError

DEFAULT_PLUGINS = (
    "cadenza.attention_backends.builtins",
    "cadenza.samplers.builtins",
    "cadenza.policies.eviction",
    "cadenza.policies.context",
    "cadenza.speculative.builtins",
    "cadenza.kv_connectors.builtins",
    "cadenza.parsers.builtins",
)
ENTRY_POINT_GROUP = "cadenza"
ALLOWLIST_ENV = environment.PLUGINS.name

T = TypeVar("T")


@dataclass
class Registry(Generic[T]):
    """Names to factories of one kind, remembering which plugin registered each name."""

    kind: str
    base: type
    _entries: dict[str, tuple[T, str]] = field(default_factory=dict)

    def add(self, name: str, factory: T, source: str) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {source!r} registered a {self.kind} with an invalid name {name!r}")
        if name in self._entries:
            first = self._entries[name][1]
            raise PluginError(f"{self.kind} {name!r} is registered twice: by {first!r} and by {source!r}")
        self._entries[name] = (factory, source)

    def get(self, name: str) -> T:
        try:
            return self._entries[name][0]
        except KeyError:
            raise UnknownNameError(self.kind, name, list(self._entries)) from None

    def source_of(self, name: str) -> str:
        self.get(name)
        return self._entries[name][1]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


@dataclass
class Registries:
    """Everything plugins registered, resolved once; per-request code reads these, never `pm.hook`."""

    attention_backends: Registry
    samplers: Registry
    logits_processors: Registry
    eviction_policies: Registry
    context_policies: Registry
    context_providers: Registry
    proposers: Registry
    kv_connectors: Registry
    reasoning_parsers: Registry
    tool_parsers: Registry
    # Wire protocols (api/protocols.py): checked to be `Protocol`s where the app mounts them, since
    # that contract lives above this layer.
    protocols: Registry
    plugin_names: list[str]


def _new_registries() -> Registries:
    from cadenza.attention_backends.base import AttentionBackend
    from cadenza.kv_connectors.base import KVConnector
    from cadenza.parsers.reasoning import ReasoningParser
    from cadenza.parsers.tool_calls import ToolParser
    from cadenza.policies.context import ContextPolicy, ContextProvider
    from cadenza.policies.eviction import EvictionPolicy
    from cadenza.samplers.base import LogitsProcessor, Sampler
    from cadenza.speculative.base import Proposer

    return Registries(
        attention_backends=Registry("attention backend", AttentionBackend),
        samplers=Registry("sampler", Sampler),
        logits_processors=Registry("logits processor", LogitsProcessor),
        eviction_policies=Registry("eviction policy", EvictionPolicy),
        context_policies=Registry("context policy", ContextPolicy),
        context_providers=Registry("context provider", ContextProvider),
        proposers=Registry("proposer", Proposer),
        kv_connectors=Registry("KV connector", KVConnector),
        reasoning_parsers=Registry("reasoning parser", ReasoningParser),
        tool_parsers=Registry("tool parser", ToolParser),
        protocols=Registry("protocol", object),
        plugin_names=[],
    )


def make_plugin_manager(
    modules: Iterable[str] = (),
    *,
    entry_points: bool = True,
    env: Mapping[str, str] | None = None,
    extra_plugins: Iterable[object] = (),
) -> pluggy.PluginManager:
    """A plugin manager holding the built-ins, allowed entry points, `modules` and `extra_plugins`."""
    env = os.environ if env is None else env
    allow = _allowlist(env)
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(name), name=name)
    if entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allow is not None and ep.name not in allow and ep.value not in allow:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginError(f"plugin entry point {ep.name!r} ({ep.value}) failed to load: {exc!r}") from exc
            _register(pm, plugin, f"entry point {ep.name}")
    for module_name in modules:
        if allow is not None and module_name not in allow:
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise PluginError(f"plugin module {module_name!r} failed to import: {exc!r}") from exc
        _register(pm, module, module_name)
    for plugin in extra_plugins:
        _register(pm, plugin, getattr(plugin, "__name__", type(plugin).__name__))
    try:
        pm.check_pending()  # a misspelled hook name would otherwise register nothing, silently
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"a plugin implements a hook cadenza does not define: {exc}") from exc
    return pm


def _allowlist(env: Mapping[str, str]) -> set[str] | None:
    raw = env.get(ALLOWLIST_ENV)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _register(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    if pm.is_registered(plugin):
        return  # the same module named twice (config and entry point) loads once
    try:
        pm.register(plugin, name=name)
    except ValueError as exc:
        raise PluginError(f"plugin {name!r} could not be registered: {exc}") from exc
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {name!r} implements a hook wrongly: {exc}") from exc


def collect_registries(pm: pluggy.PluginManager) -> Registries:
    """Call every registration hook once, plugin by plugin, so each name knows its source."""
    registries = _new_registries()
    samplers_router = _route_sampler_kinds(registries)
    hooks: list[tuple[str, Callable[[str, Any, str], None]]] = [
        ("register_attention_backends", _checked(registries.attention_backends)),
        ("register_samplers", samplers_router),
        ("register_eviction_policies", _checked(registries.eviction_policies)),
        ("register_context_policies", _checked(registries.context_policies)),
        ("register_context_providers", _checked(registries.context_providers)),
        ("register_proposers", _checked(registries.proposers)),
        ("register_kv_connectors", _checked(registries.kv_connectors)),
        ("register_reasoning_parsers", _checked(registries.reasoning_parsers)),
        ("register_tool_parsers", _checked(registries.tool_parsers)),
        ("register_protocols", _checked(registries.protocols)),
    ]
    for hook_name, add in hooks:
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            source = impl.plugin_name

            def register(name: str, factory: Any, _source: str = source, _add=add) -> None:
                _add(name, factory, _source)

            try:
                impl.function(register=register)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(f"plugin {source!r} raised in {hook_name}: {exc!r}") from exc
    registries.plugin_names = [name for name, _ in pm.list_name_plugin()]
    return registries


def _checked(registry: Registry) -> Callable[[str, Any, str], None]:
    from pydantic import BaseModel

    def add(name: str, factory: Any, source: str) -> None:
        if not (isinstance(factory, type) and issubclass(factory, registry.base)):
            raise PluginError(
                f"plugin {source!r} registered {registry.kind} {name!r} as {factory!r}, "
                f"which is not a subclass of {registry.base.__name__}"
            )
        for attr in ("params_model", "options_model"):
            # Checked now, so a bad model fails start-up rather than the first request using it.
            model = getattr(factory, attr, None)
            if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise PluginError(
                    f"plugin {source!r} registered {registry.kind} {name!r} whose {attr} is {model!r}, "
                    "not a pydantic model class"
                )
        registry.add(name, factory, source)

    return add


def _route_sampler_kinds(registries: Registries) -> Callable[[str, Any, str], None]:
    add_sampler = _checked(registries.samplers)
    add_processor = _checked(registries.logits_processors)

    def add(name: str, factory: Any, source: str) -> None:
        if isinstance(factory, type) and issubclass(factory, registries.logits_processors.base):
            add_processor(name, factory, source)
        else:
            add_sampler(name, factory, source)

    return add


def load_registries(
    modules: Iterable[str] = (),
    *,
    entry_points: bool = True,
    env: Mapping[str, str] | None = None,
    extra_plugins: Iterable[object] = (),
) -> Registries:
    """Load plugins and resolve every registered name: the one call an engine makes at start-up."""
    pm = make_plugin_manager(modules, entry_points=entry_points, env=env, extra_plugins=extra_plugins)
    return collect_registries(pm)
