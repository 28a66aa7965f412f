"""`Served`: what a server serves, as its front ends read it.

Two things implement it: one engine's `Runtime` (runtime/build.py), and the replica front end of
data-parallel or disaggregated replicas (`ReplicaFrontEnd`, cluster/replicas.py). Both subclass
it, so what they share is written once here; the API layer reads only what this names.
"""

from __future__ import annotations

from typing import Any, Protocol

from cadenza.config import CadenzaConfig
from cadenza.runtime.registries import Registries
from cadenza.samplers.extra import ExtraParams


class Served(Protocol):
    """The served model and its deployment: its config, plugins, tokenizer and limits."""

    config: CadenzaConfig
    registries: Registries
    loaded: Any  # .arch, .tokenizer and .max_model_len (a `LoadedModel`, or the replicas' tokenizer alone)
    num_blocks: int  # KV blocks an engine holds (the smallest replica's, across replicas)
    extra_params: ExtraParams | None  # what `SamplingParams.extra` may name; None: nothing

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    def failure(self) -> str | None:
        """Why it can no longer serve (a tensor-parallel rank or a replica died), or None."""
        ...

    def close(self) -> None:
        """Stop what it started beside this process (ranks, replicas); idempotent."""
        ...
