"""Resolving a config's plugin names: the classes it names, each with its validated `plugin_options`.

Every name in the config (attention backend, sampler, logits processors, eviction policy, context
policy and providers, proposers, KV connector) and every `plugin_options` entry is resolved here,
so a typo fails before the first request with the list of known names, and a bad option with its
key path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from pydantic import BaseModel, ValidationError

from cadenza.config import CadenzaConfig
from cadenza.config.errors import ConfigError, key_path
from cadenza.runner.device import resolve_device
from cadenza.runtime.registries import Registries, load_registries
from cadenza.speculative.setup import proposer_classes


@dataclass
class Plugins:
    """The classes a config names, and the validated `plugin_options` of each (None: no options)."""

    registries: Registries
    attention_backend: type
    sampler: type
    logits_processors: list[type]
    eviction_policy: type
    options: dict[str, BaseModel | None]
    # The tiers' own eviction policies (`cache.host_eviction_policy`, `cache.disk_eviction_policy`).
    tier_eviction_policies: dict[str, type] = field(default_factory=dict)

    def build(self, cls: type, *args: Any, **kwargs: Any) -> Any:
        """`cls(*args, **kwargs)`, with `options=` when the class takes options."""
        if cls.options_model is not None:
            kwargs["options"] = self.options.get(cls.name)
        return cls(*args, **kwargs)


def attention_backend_name(config: CadenzaConfig) -> str:
    """The backend `attention_backend` names; auto: triton on CUDA, torch_sdpa on the CPU."""
    if config.attention_backend != "auto":
        return config.attention_backend
    return "triton" if resolve_device(config.model.device).type == "cuda" else "torch_sdpa"


def resolve_plugins(config: CadenzaConfig, extra_plugins: Iterable[object] = ()) -> Plugins:
    """Load plugins, resolve the config's names and validate `plugin_options`; loads no model."""
    registries = load_registries(config.plugins, extra_plugins=extra_plugins)
    plugins = Plugins(
        registries,
        attention_backend=registries.attention_backends.get(attention_backend_name(config)),
        sampler=registries.samplers.get(config.sampling.sampler),
        logits_processors=[registries.logits_processors.get(n) for n in config.sampling.logits_processors],
        eviction_policy=registries.eviction_policies.get(config.cache.eviction_policy),
        options={},
        tier_eviction_policies={
            tier: registries.eviction_policies.get(getattr(config.cache, f"{tier}_eviction_policy"))
            for tier in ("host", "disk")
        },
    )
    configured = [plugins.attention_backend, plugins.sampler, *plugins.logits_processors, plugins.eviction_policy,
                  *plugins.tier_eviction_policies.values()]  # fmt: skip
    # The deployment's default context policy and providers (the sessions' own picks are checked as they make them).
    configured.append(registries.context_policies.get(config.sessions.context_policy))
    configured += [registries.context_providers.get(name) for name in config.sessions.context_providers]
    configured += proposer_classes(config, registries)
    # The KV connector's name and options (prefill/decode disaggregation; parallel/disaggregation.py).
    configured.append(registries.kv_connectors.get(config.parallel.disaggregation.connector))
    if config.server.reasoning_parser not in ("auto", "none"):  # a name that does not exist fails start-up here
        configured.append(registries.reasoning_parsers.get(config.server.reasoning_parser))
    if config.server.tool_parser != "auto":
        configured.append(registries.tool_parsers.get(config.server.tool_parser))
    plugins.options = _validate_options(config.plugin_options, registries, configured)
    return plugins


def _validate_options(given: dict[str, dict[str, Any]], registries: Registries, configured: list[type]) -> dict[str, BaseModel | None]:
    registered = {
        name: registry.get(name)
        for registry in (registries.attention_backends, registries.samplers, registries.logits_processors,
                         registries.eviction_policies, registries.context_policies, registries.context_providers,
                         registries.proposers, registries.kv_connectors)
        for name in registry.names()
    }
    problems = []
    for name in given:
        cls = registered.get(name)
        if cls is None:
            problems.append(f"plugin_options.{name}: no plugin registers {name!r}; registered: {', '.join(sorted(registered))}")
        elif cls.options_model is None:
            problems.append(f"plugin_options.{name}: {name!r} takes no options")
    options: dict[str, BaseModel | None] = {}
    for cls in configured:
        if cls.options_model is None:
            continue
        try:
            options[cls.name] = cls.options_model.model_validate(given.get(cls.name, {}))
        except ValidationError as exc:
            problems += [
                f"{key_path(('plugin_options', cls.name, *err['loc']))}: {err['msg']}" for err in exc.errors(include_url=False)
            ]
    if problems:
        raise ConfigError(problems)
    return options
