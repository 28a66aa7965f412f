"""Sampling: logits processors and samplers behind one pipeline (see `base` for the contracts).

The built-in processors and the `default` sampler live in their own modules and reach the engine
through the plugin registry (`cadenza.samplers.builtins`), like any third-party plugin.

May import: policies/, kv_connectors/, plugins/, models/ and everything below. Not
speculative/, which sits above it.
"""

from cadenza.samplers.base import (
    LogitsProcessor,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    SamplingComponent,
    SamplingContext,
    SamplingError,
)
from cadenza.samplers.extra import ExtraParams, ExtraParamsError
from cadenza.samplers.pipeline import SamplingPipeline

__all__ = [
    "ExtraParams",
    "ExtraParamsError",
    "LogitsProcessor",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingComponent",
    "SamplingContext",
    "SamplingError",
    "SamplingPipeline",
]
