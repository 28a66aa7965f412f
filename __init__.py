"""cadenza: an asyncio actor-based LLM inference engine."""

from cadenza.kernels.cpu.features import apply_cpu_kind_to_torch
from cadenza.outputs import CompletionOutput, RequestOutput
from cadenza.sampling_params import SamplingParams
from cadenza.threads.compute_thread import apply_openmp_defaults

# Before torch loads, which reads both once: CADENZA_CPU's kind holds for PyTorch's kernels too,
# and OpenMP's threads spin briefly before they sleep (docs/cpu-threads.md).
apply_cpu_kind_to_torch()
apply_openmp_defaults()

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `import cadenza` stays light: the model stack (torch, tokenizers) loads on first use.
    if name == "LLM":
        from cadenza.llm import LLM

        return LLM
    raise AttributeError(f"module 'cadenza' has no attribute {name!r}")
