"""`model.quantization: int8`: a float checkpoint's linears quantized on load, weight-only, per group.

Each 2-D weight (every projection, the embedding, an untied LM head) whose input width is a
multiple of 32 becomes GGUF Q8_0 blocks: per group of 32 input values one float16 scale (the
group's largest magnitude / 127) and 32 int8 values rounded to nearest. Those blocks then run on
the very kernels a Q8_0 GGUF file runs on (`models/quantized_linear.py`), so an int8 deployment of a
Hugging Face checkpoint gets the native path's decode speed and about half of bf16's weight memory,
with no second kernel to keep correct. A weight whose width is not a multiple of 32 stays float
(with the rest of its fused group, whose parts must agree), and the loader says so.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping

import structlog
import torch

from cadenza.models.moe import is_router_weight
from cadenza.models.quantized_linear import QuantizedTensor

log = structlog.get_logger(__name__)

Q8_0 = 8  # gguf.GGMLQuantizationType.Q8_0
GROUP = 32
_BLOCK_BYTES = 2 + GROUP  # float16 scale, then 32 int8 values

# A fused projection's parts (models/llama.py): all quantized or none.
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def quantize_q8_0(weight: torch.Tensor) -> QuantizedTensor:
    """`weight` [rows, K] (K a multiple of 32) as Q8_0 blocks, laid out as a GGUF file stores them."""
    rows, k = weight.shape
    if k % GROUP:
        raise ValueError(f"Q8_0 needs a width that is a multiple of {GROUP}, got {k}")
    groups = weight.detach().float().reshape(rows, k // GROUP, GROUP)
    # The scale as stored (float16) is the one the values are rounded against, so that de-quantized
    # value = q * stored scale is the nearest grid point llama.cpp's own quantizer would give.
    scale = (groups.abs().amax(dim=-1, keepdim=True) / 127).half()
    inverse = torch.where(scale == 0, torch.zeros_like(scale, dtype=torch.float32), 1 / scale.float())
    values = torch.round(groups * inverse).clamp_(-127, 127).to(torch.int8)
    blocks = torch.empty(rows, k // GROUP, _BLOCK_BYTES, dtype=torch.uint8)
    blocks[..., :2] = scale.view(torch.uint8)
    blocks[..., 2:] = values.view(torch.uint8)
    return QuantizedTensor(blocks.reshape(rows, -1), Q8_0, k)


def plan_int8_weights(shapes: Mapping[str, tuple[int, ...]]) -> frozenset[str]:
    """The checkpoint names (HF layout) to quantize: 2-D weights of width a multiple of 32 (not an
    expert router's), fused groups all or none. Logs what stays float and why."""
    candidates = {name: shape for name, shape in shapes.items()
                  if name.endswith(".weight") and len(shape) == 2 and not is_router_weight(name)}
    fits = {name: shape[1] % GROUP == 0 for name, shape in candidates.items()}
    groups: dict[str, list[str]] = {}
    for name in candidates:
        module = name.removesuffix(".weight")
        prefix, _, leaf = module.rpartition(".")
        groups.setdefault(f"{prefix}.{_FUSED[leaf]}" if leaf in _FUSED else module, []).append(name)
    kept = frozenset(n for members in groups.values() if all(fits[m] for m in members) for n in members)
    left = sorted(set(candidates) - kept)
    log.info("int8 weights: quantized on load to Q8_0 blocks", tensors=len(kept))
    if left:
        log.info("int8 weights: kept float", tensors=len(left), first=left[0],
                 reason=f"input width not a multiple of {GROUP}, or fused with one that is not")
    return kept


def iter_int8_weights(weights: Iterable[tuple[str, torch.Tensor]], names: frozenset[str]) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """`weights` with those in `names` quantized (one tensor at a time: no float copy stays)."""
    for name, tensor in weights:
        yield (name, quantize_q8_0(tensor)) if name in names else (name, tensor)
