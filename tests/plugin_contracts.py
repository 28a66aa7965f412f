"""What counts as the plugin contract, found by introspection, for the meta-tests.

A contract member is named after the class that defines it (`SamplingComponent.on_request_added`
is shared by processors and samplers), so the docs and tests name each one once.
"""

from __future__ import annotations

import inspect

from cadenza.api.protocols import Protocol
from cadenza.attention_backends.base import AttentionBackend
from cadenza.parsers.reasoning import ReasoningParser, ReasoningStream
from cadenza.parsers.tool_calls import ToolParser
from cadenza.plugins import hookspecs
from cadenza.policies.context import ContextPolicy, ContextProvider
from cadenza.policies.eviction import EvictionPolicy
from cadenza.samplers.base import LogitsProcessor, Sampler
from cadenza.speculative.base import Proposer

CONTRACTS = (LogitsProcessor, Sampler, EvictionPolicy, AttentionBackend, ContextPolicy, ContextProvider, Proposer,
             ReasoningParser, ReasoningStream, ToolParser, Protocol)
_DUNDERS = ("__init__", "__len__")


def _defines(klass: type, member: str) -> bool:
    return member in vars(klass) or member in vars(klass).get("__annotations__", {})


def contract_members() -> list[str]:
    """`DefiningClass.member` for every public method, class attribute, constructor and `__len__`."""
    members = set()
    for contract in CONTRACTS:
        bases = [k for k in contract.__mro__ if k.__module__.startswith("cadenza.")]
        names = {n for k in bases for n in (*vars(k), *vars(k).get("__annotations__", {})) if not n.startswith("_")}
        names |= {n for n in _DUNDERS if any(n in vars(k) for k in bases)}
        for name in names:
            owner = next(k for k in bases if _defines(k, name))
            members.add(f"{owner.__name__}.{name}")
    return sorted(members)


def hookspec_names() -> list[str]:
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    return sorted(n for n, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, marker))


def covers(*members: str):
    """Mark a test as the one exercising these contract members or hooks (checked by a meta-test)."""

    def mark(test):
        test.covers = (*getattr(test, "covers", ()), *members)
        return test

    return mark
