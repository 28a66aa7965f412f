"""Rotary position embeddings with the frequency schedules of the checkpoints we load."""

from __future__ import annotations

import math

import torch

from cadenza.kernels.rotary import apply_rotary
from cadenza.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """The per-pair inverse frequencies, computed exactly as transformers does (fp32)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    if rope.rope_type == "longrope":  # the short factors: positions below the original context
        return 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32, device="cpu") * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_scaled(rope, head_dim)
    return inv_freq


def _yarn_scaled(rope: RopeConfig, dim: int) -> torch.Tensor:
    # YaRN: the fastest-turning pairs keep their frequency (extrapolated), the slowest are divided
    # by `factor` (interpolated), those between blended along a linear ramp over the pair index.
    # The ramp's ends are the pairs that turn beta_fast and beta_slow times over the original context.
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)

    def pair_turning(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = pair_turning(rope.beta_fast), pair_turning(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Looks up cos/sin for arbitrary (non-contiguous) positions from a table built once."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        """`head_dim`: the dimensions rotated (a head's leading ones, under partial rotary)."""
        super().__init__()
        self.dim = head_dim
        # Built on the CPU even under a meta-device context (a model's skeleton): meta math runs
        # PyTorch's Python references, whose first use imports torch._dynamo (1.3 s). `.to()` moves it.
        inv_freq = inverse_frequencies(rope, head_dim)
        if rope.rope_type == "longrope" and max_positions > rope.original_max_position_embeddings:
            # LongRoPE's long factors wherever the context may outgrow the original one, for every
            # position (llama.cpp's rule: by the context length served). transformers switches a
            # sequence to them once it is longer, re-rotating its whole past, which a cache of
            # rotated keys cannot; served within the original context, the short ones.
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
            inv_freq = 1.0 / (torch.tensor(rope.long_factor, dtype=torch.float32, device="cpu") * rope.theta**exponents)
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        table = torch.cat((freqs, freqs), dim=-1)
        scale = rope.attention_factor
        self.register_buffer("cos_table", table.cos() * scale if scale != 1.0 else table.cos(), persistent=False)
        self.register_buffer("sin_table", table.sin() * scale if scale != 1.0 else table.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim] for `positions` [T], cast like transformers casts them."""
        cos = self.cos_table[positions].to(dtype).unsqueeze(1)
        sin = self.sin_table[positions].to(dtype).unsqueeze(1)
        return cos, sin


class StepRotary:
    """One step's rotary embedding: the positions' cos/sin, applied by the CPU kernel in place
    where it runs (float32, packed heads), else by `apply_rotary`."""

    __slots__ = ("_embedding", "_positions", "_dtype", "_kernels", "_layer_ops", "_cos_sin")

    def __init__(self, embedding: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype, kernels=None,
                 layer_ops=None) -> None:
        """`kernels`: the CPU kernels; `layer_ops`: kernels/triton/layer_ops.py (a model's
        `use_layer_ops`), which rotates in place where it can (`layer_ops.rotates`)."""
        self._embedding, self._positions, self._dtype = embedding, positions, dtype
        usable = kernels is not None and dtype == torch.float32 and positions.device.type == "cpu"
        self._kernels = kernels if usable else None
        self._layer_ops = layer_ops if layer_ops is not None and layer_ops.rotates(embedding.dim) else None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None  # looked up on first use

    @property
    def positions(self) -> torch.Tensor:
        return self._positions

    @property
    def on_kernels(self) -> bool:
        """Whether the CPU kernels rotate this step (float32 activations, positions on the CPU)."""
        return self._kernels is not None

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated; in place (and returned) where the kernel runs. Under
        partial rotary only the leading dimensions turn, written back into `x`."""
        if self._layer_ops is not None and x.stride(-1) == 1:
            emb = self._embedding
            return self._layer_ops.rotary_(x, self._positions, emb.cos_table, emb.sin_table, emb.dim)
        if x.shape[-1] != self._embedding.dim:
            part = x[..., : self._embedding.dim]
            part.copy_(self._rotate(part.contiguous()))
            return x
        return self._rotate(x)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None and x.dtype == torch.float32 and x.stride(-1) == 1 and x.stride(1) == x.shape[2]:
            self._kernels.rotary_(x, self._positions, self._embedding.cos_table, self._embedding.sin_table)
            return x
        if self._cos_sin is None:
            self._cos_sin = self._embedding.cos_sin(self._positions, self._dtype)
        return apply_rotary(x, *self._cos_sin)
