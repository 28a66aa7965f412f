"""MXFP4 (GGML type 39), the weights gpt-oss keeps its experts in: blocks of 32 E2M1 values sharing
one E8M0 exponent (the OCP microscaling format).

Two layouts of the same numbers:

- GGUF's `block_mxfp4`, what cadenza's kernels read (kernels/cpu/quant.h): 17 bytes a block, the
  exponent byte e, then 16 bytes qs where value j (j < 16) is the low nibble of qs[j] and value
  j + 16 its high nibble. A nibble indexes the E2M1 values doubled, {0, 1, 2, 3, 4, 6, 8, 12} and
  their negatives (index 8: -0), and the block scales them by 2^(e - 128).
- A Hugging Face gpt-oss checkpoint's `*_blocks` uint8 [..., n_blocks, 16] and `*_scales` uint8
  [..., n_blocks]: value 2i is the low nibble of byte i and value 2i + 1 its high nibble, indexing
  the E2M1 values themselves, scaled by 2^(scale - 127).

So the exponent byte is the same in both (the doubled values take the halved scale) and only the
nibbles move: `mxfp4_from_hf` re-lays them as llama.cpp's converter writes the GGUF.
"""

from __future__ import annotations

import torch

QTYPE = 39  # GGML's type id (gguf.GGMLQuantizationType.MXFP4)
BLOCK_VALUES, BLOCK_BYTES = 32, 17

# The E2M1 values doubled, by 4-bit index (ggml's kvalues_mxfp4); index 8 is E2M1's -0.
DOUBLED_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# E2M1's magnitudes (index 0-7; bit 3 is the sign), as the checkpoint's nibbles index them.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# The largest exponent byte the quantizer writes: 255 would scale by 2^128, infinite in float32
# (transformers' de-quantizer), where ggml reads it as 2^127.
MAX_SCALE = 254


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 128) as float32 for exponent bytes e (uint8), exactly as ggml's
    GGML_E8M0_TO_FP32_HALF: the float bits (e - 1) << 23, and for e < 2 the denormals 2^-127 (e = 1)
    and 2^-128 (e = 0), which a float32 power of two computed in arithmetic could flush or round."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
    return bits.view(torch.float32)


def dequantize_mxfp4(raw: torch.Tensor) -> torch.Tensor:
    """GGUF MXFP4 blocks, uint8 [..., 17 * n], de-quantized to float32 [..., 32 * n], exactly as
    ggml's `dequantize_row_mxfp4` (every value is a power of two times an integer of at most 12)."""
    if raw.dtype != torch.uint8 or raw.shape[-1] % BLOCK_BYTES:
        raise ValueError(f"MXFP4 blocks are uint8 rows of whole {BLOCK_BYTES}-byte blocks, "
                         f"not {raw.dtype} {tuple(raw.shape)}")
    blocks = raw.reshape(*raw.shape[:-1], raw.shape[-1] // BLOCK_BYTES, BLOCK_BYTES)
    qs = blocks[..., 1:]
    index = torch.cat([qs & 0x0F, qs >> 4], dim=-1).long()  # values 0-15 from the low nibbles, 16-31 the high
    values = torch.tensor(DOUBLED_VALUES, dtype=torch.float32)[index]
    out = values * e8m0_half(blocks[..., 0]).unsqueeze(-1)
    return out.reshape(*raw.shape[:-1], -1)


def mxfp4_from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A Hugging Face checkpoint's MXFP4 weight, `blocks` uint8 [..., n_blocks, 16] and `scales`
    uint8 [..., n_blocks], as GGUF blocks uint8 [..., n_blocks * 17]: the bytes llama.cpp's
    convert_hf_to_gguf.py writes for it (the scale byte as it is, the nibbles re-laid from
    value 2i and 2i + 1 in byte i to value j and j + 16 in byte j)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., n, 16] and scales [..., n], "
                         f"not {tuple(blocks.shape)} and {tuple(scales.shape)}")
    # Each value's nibble in order: value 2i, then 2i + 1, from byte i.
    nibbles = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], BLOCK_VALUES)
    qs = nibbles[..., :16] | (nibbles[..., 16:] << 4)
    gguf = torch.cat([scales.unsqueeze(-1), qs], dim=-1)
    return gguf.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK_BYTES)


def quantize_mxfp4_hf(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., K] (K a multiple of 32) as a Hugging Face checkpoint stores MXFP4:
    (blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32]). A reference quantizer for tests
    and tiny checkpoints, not a calibrated one: each block's exponent is the smallest that fits its
    largest magnitude (6 * 2^(scale - 127) >= max |w|, within [0, 254]), each value the nearest E2M1
    value at that scale (ties to the smaller magnitude)."""
    if w.shape[-1] % BLOCK_VALUES:
        raise ValueError(f"MXFP4 needs rows of whole {BLOCK_VALUES}-value blocks, not {w.shape[-1]} values")
    groups = w.detach().to(torch.float64).reshape(*w.shape[:-1], w.shape[-1] // BLOCK_VALUES, BLOCK_VALUES)
    amax = groups.abs().amax(dim=-1)
    # amax = m * 2^x with m in [0.5, 1): 6 * 2^(x - 2) = 1.5 * 2^x fits it, and 6 * 2^(x - 3) too when m <= 0.75.
    mantissa, exponent = torch.frexp(amax)
    power = exponent - 2 - (mantissa <= 0.75).to(exponent.dtype)
    scales = torch.where(amax > 0, power + 127, torch.zeros_like(power)).clamp(0, MAX_SCALE)
    scaled = groups / torch.ldexp(torch.ones_like(amax), scales - 127).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # the first of a tie: the smaller
    index = index | ((scaled < 0) & (index > 0)).long() << 3  # no -0: a value that rounds to 0 is +0
    pairs = index.to(torch.uint8).reshape(*index.shape[:-1], 16, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), scales.to(torch.uint8)
