"""cadenza: an asyncio actor-based LLM inference engine."""

from cadenza.models.cpu_features import apply_cpu_kind_to_torch
from cadenza.sampling_params import SamplingParams

apply_cpu_kind_to_torch()  # before torch loads: CADENZA_CPU's kind holds for PyTorch's kernels too

__all__ = ["LLM", "SamplingParams", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `import cadenza` stays light: the model stack (torch, tokenizers) loads on first use.
    if name == "LLM":
        from cadenza.llm import LLM

        return LLM
    raise AttributeError(f"module 'cadenza' has no attribute {name!r}")
