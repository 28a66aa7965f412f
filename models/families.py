"""Model families as declarative differences from one decoder (models/llama.py).

A family is not a copy of the decoder: it names which of the decoder's options its checkpoints
use (q/k norms and their scope, forced biases, a mixture-of-experts MLP and its routing), how its
checkpoint names differ from the canonical ones the decoder loads, and which GGUF architecture
names stand for it. `ModelArchConfig.from_hf` and the GGUF reader turn a family plus a config into
the decoder's shape; nothing else branches on `model_type`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Family:
    model_type: str
    # q/k/v biases whatever the config's `attention_bias` says (Qwen2).
    qkv_bias: bool = False
    # Whether the output projection has a bias when the config's `attention_bias` is set (Qwen2,
    # Mistral and Mixtral bias q/k/v at most).
    o_bias: bool = True
    # RMSNorm on queries and keys before rotary: None, "head" (over each head: Qwen3) or "full"
    # (over the whole q and k projections: OLMoE).
    qk_norm: str | None = None
    # Whether `sliding_window` in the config applies to every layer (Mistral, Mixtral); Qwen's
    # per-layer windows (`use_sliding_window`) are refused rather than computed wrongly.
    honours_sliding_window: bool = False
    # Mixture-of-experts MLP (models/moe.py), and whether the top-k routing weights are
    # renormalised to sum to 1 (None: the config's `norm_topk_prob`).
    moe: bool = False
    normalize_top_k: bool | None = None
    # What a normalise flag defaults to in a GGUF file that lacks `expert_weights_norm`: what
    # llama.cpp's graph for the architecture does.
    gguf_normalize_top_k: bool = False
    # Gemma 3's differences (models/config.py `_gemma_options`): local and global layers, norms
    # around each block, scaled embeddings.
    gemma: bool = False
    # gpt-oss's differences (models/config.py `_gpt_oss_options`): attention sinks, alternating
    # sliding and full layers, a biased router whose softmax runs over the top k, biased experts
    # with a clamped SwiGLU, stored as 3-D tensors with gate and up interleaved.
    gpt_oss: bool = False
    # Checkpoint name fragments as this family writes them -> the canonical ones (Mixtral's
    # `block_sparse_moe.experts.N.w1` is `mlp.experts.N.gate_proj`).
    renames: tuple[tuple[str, str], ...] = ()

    def canonical_name(self, name: str) -> str:
        for old, new in self.renames:
            name = name.replace(old, new)
        return name


FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("llama"),
        Family("mistral", o_bias=False, honours_sliding_window=True),
        Family("qwen2", qkv_bias=True, o_bias=False),
        Family("qwen3", qk_norm="head"),
        Family("qwen3_moe", qk_norm="head", moe=True, gguf_normalize_top_k=True),
        Family(
            "mixtral",
            o_bias=False,
            honours_sliding_window=True,
            moe=True,
            normalize_top_k=True,
            gguf_normalize_top_k=True,
            renames=((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w2.", ".down_proj."),
                     (".w3.", ".up_proj.")),
        ),
        Family("olmoe", qk_norm="full", moe=True),
        # Checkpoints with q/k/v and gate/up already fused (the decoder's own layout), partial rotary
        # (Phi-4-mini) and LongRoPE.
        Family("phi3", honours_sliding_window=True),
        Family("gemma3_text", qk_norm="head", gemma=True),
        # Llama's decoder with some layers not rotating (config no_rope_layers).
        Family("smollm3"),
        # Llama's decoder with multipliers (config embedding/residual/attention_multiplier, logits_scaling).
        Family("granite", o_bias=True),
        Family("gpt_oss", moe=True, gpt_oss=True, renames=((".mlp.router.", ".mlp.gate."),)),
    )
}

# GGUF `general.architecture` -> model_type; "llama" with experts is Mixtral (`gguf_model_type`).
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen3moe": "qwen3_moe", "olmoe": "olmoe", "smollm3": "smollm3", "granite": "granite",
                      "phi3": "phi3", "gemma3": "gemma3_text",
                      "gpt-oss": "gpt_oss"}


def gguf_model_type(arch: str, expert_count: int) -> str | None:
    """The family of a GGUF file's architecture (None: not one cadenza runs)."""
    model_type = GGUF_ARCHITECTURES.get(arch)
    if model_type == "llama" and expert_count > 0:
        return "mixtral"
    return model_type
