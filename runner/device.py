"""Where and in what precision the model runs: `model.device`, `model.dtype` and `cache.dtype` as
torch values (one resolution, used by the runtime, the draft model and the benches)."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device is 'cuda' but no CUDA GPU is available; use 'cpu' or 'auto'")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    # bfloat16 by default: on CPU it halves the bytes each decode step reads, at fp32's range.
    return torch.bfloat16 if name == "auto" else _DTYPES[name]


def resolve_kv_dtype(name: str, compute_dtype: torch.dtype, int8_activations: bool = False) -> torch.dtype:
    """`cache.dtype` as a torch dtype; torch.int8 is the quantized cache (see `runner/kv_cache.py`).

    auto: bfloat16 wherever attention computes in bfloat16, and also where the linears round their
    activations to int8 (block-quantized weights, `int8_activations`: a GGUF's, or
    `quantization: int8`), whose error bfloat16 keys and values stay far below (~2^-9 of a value
    against int8's ~2^-8 of a block's largest); the CPU decode kernels read 16-bit rows widened to
    float32 at float32's speed. Half float32's bytes, as llama.cpp's default f16 cache. Otherwise
    the dtype attention computes in: float32 attention over float weights stays exact to the
    reference (transformers in float32)."""
    if name == "auto":
        if compute_dtype == torch.float32 and int8_activations:
            return torch.bfloat16
        return compute_dtype
    return torch.int8 if name == "int8" else _DTYPES[name]
