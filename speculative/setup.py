"""Which proposers a deployment builds, and the runner's `Speculator` over them (at start-up)."""

from __future__ import annotations

from cadenza.speculative.base import ProposerContext
from cadenza.speculative.speculator import Speculator

# Cheap and model-free: always built, so a request may pick either whatever the deployment's method.
ALWAYS_BUILT = ("ngram", "suffix")


def proposer_classes(config, registries) -> list[type]:
    """The proposer classes `config` builds; an unknown `speculative.method` raises
    `UnknownNameError` listing the registered ones."""
    names = list(ALWAYS_BUILT)
    if config.speculative.method not in ("none", *names):
        names.append(config.speculative.method)
    return [registries.proposers.get(name) for name in names]


def build_speculator(config, plugins, loaded, device, load_draft=None) -> Speculator:
    """Instantiate the proposers (with their `plugin_options`) for the runner; `load_draft` builds
    a draft model for a proposer that asks (`ProposerContext.load_draft`)."""
    context = ProposerContext(
        vocab_size=loaded.arch.vocab_size,
        eos_token_ids=tuple(loaded.tokenizer.eos_token_ids),
        max_model_len=loaded.max_model_len,
        device=device,
        dtype=loaded.compute_dtype,
        tokenizer=loaded.tokenizer,
        model_path=config.model.path,
        load_draft=load_draft,
    )
    proposers = {cls.name: plugins.build(cls, context) for cls in proposer_classes(config, plugins.registries)}
    return Speculator(proposers, config.speculative.method, loaded.arch.vocab_size, config.speculative.token_cost)


def built_methods(runner) -> frozenset[str] | None:
    """The proposer names a runner can serve (for the ingress's check); None when it has no speculator."""
    speculator = getattr(runner, "speculator", None)
    return None if speculator is None else frozenset(speculator.proposers) | {"none"}
