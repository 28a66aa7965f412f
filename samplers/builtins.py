"""cadenza's own samplers and logits processors, registered as a third-party plugin would be."""

from __future__ import annotations

from cadenza.plugins.hookspecs import Register, hookimpl
from cadenza.samplers.default_sampler import DefaultSampler
from cadenza.samplers.logits_processors import (
    LogitBiasProcessor,
    MinPProcessor,
    MinTokensProcessor,
    TemperatureProcessor,
    TopKTopPProcessor,
)
from cadenza.samplers.penalties import PenaltiesProcessor
from cadenza.samplers.structured import StructuredOutputProcessor

BUILTINS = (
    StructuredOutputProcessor,
    MinTokensProcessor,
    LogitBiasProcessor,
    PenaltiesProcessor,
    TemperatureProcessor,
    MinPProcessor,
    TopKTopPProcessor,
    DefaultSampler,
)


@hookimpl
def register_samplers(register: Register) -> None:
    for cls in BUILTINS:
        register(cls.name, cls)
