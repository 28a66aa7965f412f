"""The architecture of a Llama-family decoder, read from a checkpoint's own config."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

from cadenza.models.errors import UnsupportedModelError
from cadenza.models.families import FAMILIES

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# gpt-oss's experts: min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up, +-limit) + 1).
SWIGLU_CLAMPED = "swiglu_clamped"


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # LongRoPE (Phi-3.5, Phi-4-mini): per-frequency divisors for positions below the original
    # context and from it on, and the factor cos and sin are scaled by.
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float = 1.0
    # YaRN (gpt-oss): the rotations that bound the ramp between extrapolated and interpolated
    # frequencies, and whether the ramp's ends are rounded to whole dimensions.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A mixture-of-experts MLP (models/moe.py): each token's `top_k` of `num_experts` experts,
    each a SiLU-gated MLP of `intermediate_size`, weighted by the router's softmax probabilities
    (renormalised over the top k when `normalize_top_k`); gpt-oss's router has a bias and takes
    the softmax over the k picked logits only (`softmax_after_top_k`), which is the same ranking."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    layers: tuple[int, ...]  # the decoder layers whose MLP is the mixture; the others are dense
    router_bias: bool = False
    softmax_after_top_k: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"{self.top_k} experts a token out of {self.num_experts}")


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    """Everything the decoder needs to know about its shape; independent of the file format."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: str | None  # None, "head" (each head's q and k) or "full" (the whole projections)
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None
    clip_qkv: float | None = None  # q, k and v clamped to +-this after the projection (OLMoE)
    # Which layers rotate q and k (SmolLM3's NoPE layers do not); None: every layer.
    rope_layers: tuple[bool, ...] | None = None
    # Granite's multipliers: embeddings scaled on the way in, each block's output before the
    # residual add, the logits divided on the way out, and the attention's softmax scale (None:
    # 1 / sqrt(head_dim)).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    # The leading dimensions of each head that rotary rotates (Phi-4-mini: 3/4 of them); None: all.
    rotary_dim: int | None = None
    # Gemma 3: the MLP's activation, sliding windows per layer (None where a layer sees all; the
    # whole field None: `sliding_window` for every layer) with their own rotary (`local_rope`),
    # RMSNorm weights stored as an offset from 1, and a norm after each block's output as well as
    # before the MLP ("sandwich" norms).
    hidden_act: str = "silu"
    layer_windows: tuple[int | None, ...] | None = None
    local_rope: RopeConfig | None = None
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    final_logit_softcapping: float | None = None
    # gpt-oss: a learnt logit per query head that joins each softmax's denominator (an attention
    # "sink" no value stands behind), and its experts' clamped SwiGLU (`SWIGLU_CLAMPED`).
    attention_sinks: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within (None: the whole context)."""
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    @property
    def rotated_dims(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def softmax_scale(self) -> float:
        """What attention scores are multiplied by before the softmax."""
        return self.head_dim**-0.5 if self.attention_multiplier is None else self.attention_multiplier

    def rotates(self, layer: int) -> bool:
        return self.rope_layers is None or self.rope_layers[layer]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "ModelArchConfig":
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            archs = cfg.get("architectures") or []
            raise UnsupportedModelError(
                f"{source}: unsupported architecture model_type={model_type!r} {archs}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")  # Gemma names it hidden_activation
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"{source}: unsupported hidden_act {act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
        family = FAMILIES[model_type]
        attention_bias = bool(cfg.get("attention_bias", False))
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        num_layers = int(cfg["num_hidden_layers"])
        clip = cfg.get("clip_qkv")
        options = dict(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(cfg, source),
            rotary_dim=_rotary_dim(cfg, int(head_dim)),
            hidden_act=act,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias or attention_bias,
            o_bias=attention_bias and family.o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family.qk_norm,
            sliding_window=_sliding_window(cfg, model_type, source),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            moe=_moe_from_hf(cfg, model_type, num_layers, source) if family.moe else None,
            clip_qkv=None if clip is None else float(clip),
            rope_layers=_rope_layers(cfg, num_layers, source),
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
            logits_scaling=float(cfg.get("logits_scaling", 1.0)),
            attention_multiplier=None if cfg.get("attention_multiplier") is None else float(cfg["attention_multiplier"]),
        )
        if family.gemma:
            options.update(_gemma_options(cfg, num_layers, source))
        if family.gpt_oss:
            options.update(_gpt_oss_options(cfg, options["moe"], num_layers))
        return cls(**options)


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _rope_from_hf(cfg: Mapping[str, Any], source: str) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints write
    # `rope_theta` beside an optional `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    original = int(params.get("original_max_position_embeddings",
                              cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))))
    if rope_type == "longrope":
        return _longrope(cfg, params, theta, original, source)
    if rope_type == "yarn":
        return _yarn(cfg, params, theta, original)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
    )


def _longrope(cfg: Mapping[str, Any], params: Mapping[str, Any], theta: float, original: int, source: str) -> RopeConfig:
    """LongRoPE as transformers computes it: the attention factor from the context's growth
    (max_position_embeddings over the original) unless given."""
    try:
        short, long = tuple(float(f) for f in params["short_factor"]), tuple(float(f) for f in params["long_factor"])
    except KeyError as exc:
        raise UnsupportedModelError(f"{source}: longrope scaling needs {exc.args[0]!r}") from exc
    factor = params.get("factor") or int(cfg.get("max_position_embeddings", original)) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(theta=theta, rope_type="longrope", factor=float(factor), original_max_position_embeddings=original,
                      short_factor=short, long_factor=long, attention_factor=float(attention))


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude factor on cos and sin for a context stretched `scale` times (1: none)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(cfg: Mapping[str, Any], params: Mapping[str, Any], theta: float, original: int) -> RopeConfig:
    """YaRN as transformers computes it: the attention factor from `factor` (and DeepSeek's
    `mscale`s) unless given."""
    factor = params.get("factor") or int(cfg.get("max_position_embeddings", original)) / original
    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    return RopeConfig(theta=theta, rope_type="yarn", factor=float(factor), original_max_position_embeddings=original,
                      attention_factor=float(attention), beta_fast=float(params.get("beta_fast") or 32.0),
                      beta_slow=float(params.get("beta_slow") or 1.0), truncate=bool(params.get("truncate", True)))


def _rotary_dim(cfg: Mapping[str, Any], head_dim: int) -> int | None:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    fraction = float(cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))
    return None if fraction == 1.0 else int(head_dim * fraction)


def _gemma_options(cfg: Mapping[str, Any], num_layers: int, source: str) -> dict[str, Any]:
    """Gemma 3's differences as the decoder's options: local layers (sliding window, their own
    rotary base) every layer but each `sliding_window_pattern`-th, the embeddings scaled by
    sqrt(hidden), 1/sqrt(query_pre_attn_scalar) as the softmax scale, norms around each block."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(f"{source}: attention logit soft-capping (Gemma 2) is not supported")
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    window = cfg.get("sliding_window")
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers >= 5: one set of rope parameters per layer type
        rope = _rope_from_hf({**cfg, "rope_parameters": params["full_attention"]}, source)
        local = _rope_from_hf({**cfg, "rope_parameters": params.get("sliding_attention") or {}}, source)
    else:
        rope = _rope_from_hf(cfg, source)
        local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    softcap = cfg.get("final_logit_softcapping")
    return dict(
        rope=rope,
        local_rope=local,
        layer_windows=tuple(int(window) if t == "sliding_attention" and window else None for t in types),
        embedding_multiplier=float(cfg["hidden_size"]) ** 0.5,
        attention_multiplier=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        norm_offset=1.0,
        sandwich_norms=True,
        final_logit_softcapping=None if softcap is None else float(softcap),
    )


def _gpt_oss_options(cfg: Mapping[str, Any], moe: MoEConfig, num_layers: int) -> dict[str, Any]:
    """gpt-oss's `layer_types` (sliding and full attention in turn by default) and SwiGLU clamp."""
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    window = cfg.get("sliding_window")
    windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    return gpt_oss_options(moe, windows, float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)))


def gpt_oss_options(moe: MoEConfig, layer_windows: tuple[int | None, ...], swiglu_alpha: float = 1.702,
                    swiglu_limit: float = 7.0) -> dict[str, Any]:
    """gpt-oss's differences as the decoder's options, whichever format gave its windows: every
    layer has sinks and biased attention, every MLP is a mixture of biased experts with the clamped
    SwiGLU, whose router has a bias and softmaxes its top k."""
    return dict(
        layer_windows=layer_windows,
        sliding_window=None,
        attention_sinks=True,
        mlp_bias=True,
        o_bias=True,
        hidden_act=SWIGLU_CLAMPED,
        swiglu_alpha=swiglu_alpha,
        swiglu_limit=swiglu_limit,
        moe=replace(moe, router_bias=True, softmax_after_top_k=True, normalize_top_k=False),
    )


def _rope_layers(cfg: Mapping[str, Any], num_layers: int, source: str) -> tuple[bool, ...] | None:
    """SmolLM3's `no_rope_layers`: 1 where a layer rotates, 0 where it does not (NoPE)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        return None
    if len(flags) != num_layers:
        raise UnsupportedModelError(f"{source}: no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return None if all(flags) else tuple(bool(f) for f in flags)


def _moe_from_hf(cfg: Mapping[str, Any], model_type: str, num_layers: int, source: str) -> MoEConfig:
    family = FAMILIES[model_type]
    # Qwen3-MoE: `decoder_sparse_step` and `mlp_only_layers` leave some layers dense.
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    normalize = family.normalize_top_k
    try:
        return MoEConfig(
            # Hub checkpoints write `num_experts` (Qwen, OLMoE) or `num_local_experts` (Mixtral, and
            # transformers 5 for every family).
            num_experts=int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            # Qwen names the experts' width apart from a dense layer's; Mixtral and OLMoE have only experts.
            intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            normalize_top_k=bool(cfg.get("norm_topk_prob", False)) if normalize is None else normalize,
            layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
        )
    except ValueError as exc:
        raise UnsupportedModelError(f"{source}: {exc}") from exc
    except KeyError as exc:
        raise UnsupportedModelError(f"{source}: a {model_type} config needs {exc.args[0]!r}") from exc


def _sliding_window(cfg: Mapping[str, Any], model_type: str, source: str) -> int | None:
    window = cfg.get("sliding_window")
    if FAMILIES[model_type].honours_sliding_window:
        return int(window) if window else None
    if cfg.get("use_sliding_window") and window:
        # Qwen applies the window to a subset of layers only; we would compute something else.
        raise UnsupportedModelError(f"{source}: {model_type} with use_sliding_window=true is not supported")
    return None
