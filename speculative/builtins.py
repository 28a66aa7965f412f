"""cadenza's own proposers, registered as a third-party plugin would be."""

from __future__ import annotations

from cadenza.plugins.hookspecs import Register, hookimpl
from cadenza.speculative.draft import DraftModelProposer
from cadenza.speculative.ngram import NgramProposer
from cadenza.speculative.suffix import SuffixProposer

BUILTINS = (NgramProposer, SuffixProposer, DraftModelProposer)


@hookimpl
def register_proposers(register: Register) -> None:
    for cls in BUILTINS:
        register(cls.name, cls)
