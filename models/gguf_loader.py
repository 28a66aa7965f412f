"""Reads a GGUF file: architecture from its metadata, weights under HF names: de-quantized, or
(those `plan_native_weights` picks) as raw blocks for cadenza's quantized kernels."""

from __future__ import annotations

import re
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np
import structlog
import torch

from cadenza.models.config import ModelArchConfig, MoEConfig, RopeConfig, gpt_oss_options, yarn_mscale
from cadenza.models.errors import ModelLoadError, UnsupportedModelError
from cadenza.models.families import FAMILIES, GGUF_ARCHITECTURES, gguf_model_type
from cadenza.models.gguf_file import GGUFFile, GGUFTensor
from cadenza.models.gguf_tokenizer import read_field
from cadenza.models.moe import is_router_weight
from cadenza.models.quantized_linear import NATIVE_TYPES, QuantizedTensor

log = structlog.get_logger(__name__)

# The quantizations we de-quantize (through gguf.quants, the reference implementation; MXFP4,
# which the gguf package may lack, through models/mxfp4.py).
SUPPORTED_QUANT_TYPES = frozenset(
    getattr(gguf.GGMLQuantizationType, name)
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                 "IQ4_NL", "IQ4_XS", "MXFP4")
)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# Where an architecture's file fuses what others keep apart (Phi-3: q/k/v in one tensor, and gate
# and up in `ffn_up`), into the decoder's own fused modules.
_ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # Gemma 3's norms around each block: `ffn_norm` is the one before the MLP.
    "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    # gpt-oss: the norm before the MLP is named for the attention it follows; the sinks (a vector
    # the converter names `.weight`) are the decoder's `self_attn.sinks`.
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
}
# Parameters of ours without a `.weight` suffix, whatever the file calls them.
_BARE_PARAMETERS = ("self_attn.sinks",)
# Tensors that carry no weight of ours: LongRoPE's factors, read into the config instead.
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# A mixture's experts, one 3-D tensor [experts, rows, cols] a projection: each expert's slice is
# the checkpoint tensor `mlp.experts.N.<projection>`.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp stores Llama-style q/k rows interleaved for its RoPE kernel; HF layout needs them back.
_PERMUTED_ARCHS = ("llama", "granite", "smollm3")
# llama.cpp's SmolLM3 graph leaves every fourth layer without rotary, whatever the file says.
_SMOLLM3_NOPE_STEP = 4


def open_gguf(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except Exception as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file: {exc}") from exc


def read_gguf_config(reader: GGUFFile, source: str) -> ModelArchConfig:
    arch = read_field(reader, "general.architecture")
    expert_count = int(read_field(reader, f"{arch}.expert_count", 0) or 0)
    model_type = gguf_model_type(arch, expert_count)
    if model_type is None:
        raise UnsupportedModelError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    family = FAMILIES[model_type]

    def get(key: str, default=None):
        value = read_field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return value

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = read_field(reader, "tokenizer.ggml.tokens", [])
    head_dim = int(read_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    names = {t.name for t in reader.tensors}
    eos = read_field(reader, "tokenizer.ggml.eos_token_id")
    num_layers = int(get("block_count"))
    moe = None
    if family.moe:
        moe = MoEConfig(
            num_experts=expert_count,
            top_k=int(get("expert_used_count")),
            intermediate_size=int(read_field(reader, f"{arch}.expert_feed_forward_length", None)
                                  or get("feed_forward_length")),
            normalize_top_k=bool(read_field(reader, f"{arch}.expert_weights_norm", family.gguf_normalize_top_k)),
            layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in names),
        )
    config = ModelArchConfig(
        model_type=model_type,
        # The embedding's rows are the vocabulary (Gemma's converter trims the checkpoint's padding).
        vocab_size=int(_find_tensor(reader, "token_embd.weight").shape[1]) if "token_embd.weight" in names
        else int(read_field(reader, f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=_rope(reader, arch, source),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=family.qkv_bias or "blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names or "blk.0.ffn_down.bias" in names,
        qk_norm=family.qk_norm,
        bos_token_id=read_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        moe=moe,
        rope_layers=tuple((i + 1) % _SMOLLM3_NOPE_STEP != 0 for i in range(num_layers)) if model_type == "smollm3" else None,
        # Granite's multipliers, under llama.cpp's names (absent: 1, as for every other family).
        embedding_multiplier=float(read_field(reader, f"{arch}.embedding_scale", 1.0)),
        residual_multiplier=float(read_field(reader, f"{arch}.residual_scale", 1.0)),
        logits_scaling=float(read_field(reader, f"{arch}.logit_scale", 1.0)),
        attention_multiplier=_optional_float(read_field(reader, f"{arch}.attention.scale", None)),
        rotary_dim=_rotary_dim(reader, arch, head_dim),
        sliding_window=int(read_field(reader, f"{arch}.attention.sliding_window", 0) or 0) or None
        if family.honours_sliding_window else None,
    )
    if family.gemma:
        config = replace(config, **_gemma_options(reader, arch, config))
    if family.gpt_oss:
        config = replace(config, **_gpt_oss_options(reader, arch, config))
    return config


def _gpt_oss_options(reader: GGUFFile, arch: str, config: ModelArchConfig) -> dict:
    """gpt-oss as llama.cpp's graph runs it: sliding-window layers every other one from the first
    (unless the file gives a pattern), and the SwiGLU clamp at the constants that graph fixes
    (alpha 1.702, limit 7: the file records none)."""
    return gpt_oss_options(config.moe, _layer_windows(reader, arch, config.num_layers, 2))


def _layer_windows(reader: GGUFFile, arch: str, num_layers: int, pattern: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global) as llama.cpp reads them: the file's per-layer
    flags, or a pattern n (the file's, else the architecture's `pattern`) where every n-th layer
    is global and the others slide."""
    window = int(read_field(reader, f"{arch}.attention.sliding_window", 0) or 0)
    given = read_field(reader, f"{arch}.attention.sliding_window_pattern", pattern)
    if isinstance(given, list):
        local = [bool(p) for p in given]
    else:
        local = [bool((i + 1) % int(given)) for i in range(num_layers)]
    return tuple(window if window and is_local else None for is_local in local[:num_layers])

def _gemma_options(reader: GGUFFile, arch: str, config: ModelArchConfig) -> dict:
    """Gemma 3 as llama.cpp's graph runs it: every sixth layer global unless the file says
    otherwise, local layers rotating with base 10,000 unless it says otherwise, norm weights
    already shifted by 1 in the file, 1/sqrt(head_dim) as the softmax scale (27B: of
    hidden / heads)."""
    scale = (config.hidden_size / config.num_heads) if config.num_layers == 62 else config.head_dim
    softcap = read_field(reader, f"{arch}.final_logit_softcapping", None)
    return dict(
        layer_windows=_layer_windows(reader, arch, config.num_layers, 6),
        local_rope=RopeConfig(theta=float(read_field(reader, f"{arch}.rope.freq_base_swa", 10000.0))),
        hidden_act="gelu_pytorch_tanh",
        embedding_multiplier=float(config.hidden_size) ** 0.5,
        attention_multiplier=float(scale) ** -0.5,
        sandwich_norms=True,
        final_logit_softcapping=None if not softcap else float(softcap),
    )


def _rotary_dim(reader: GGUFFile, arch: str, head_dim: int) -> int | None:
    dims = read_field(reader, f"{arch}.rope.dimension_count", None)
    return None if dims is None or int(dims) == head_dim else int(dims)


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def _rope(reader: GGUFFile, arch: str, source: str) -> RopeConfig:
    theta = float(read_field(reader, f"{arch}.rope.freq_base", 10000.0))
    long, short = _find_tensor(reader, "rope_factors_long.weight"), _find_tensor(reader, "rope_factors_short.weight")
    if long is not None and short is not None:  # Phi-3's LongRoPE, its factors as tensors
        original = int(read_field(reader, f"{arch}.rope.scaling.original_context_length"))
        return RopeConfig(theta=theta, rope_type="longrope", original_max_position_embeddings=original,
                          short_factor=tuple(float(f) for f in np.asarray(short.data, dtype=np.float32)),
                          long_factor=tuple(float(f) for f in np.asarray(long.data, dtype=np.float32)),
                          attention_factor=float(read_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)))
    scaling = read_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling in ("none", None) and _find_tensor(reader, "rope_freqs.weight") is None:
        return RopeConfig(theta=theta)
    if scaling == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(read_field(reader, f"{arch}.rope.scaling.factor")))
    if scaling == "yarn":
        # As llama.cpp computes YaRN: the ramp's ends rounded to whole dimensions (truncated), cos
        # and sin scaled by 1 + 0.1 ln(factor) times the file's attention factor.
        factor = float(read_field(reader, f"{arch}.rope.scaling.factor"))
        return RopeConfig(
            theta=theta, rope_type="yarn", factor=factor,
            original_max_position_embeddings=int(read_field(reader, f"{arch}.rope.scaling.original_context_length")),
            beta_fast=float(read_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(read_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            truncate=True,
            attention_factor=yarn_mscale(factor) * float(read_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)),
        )
    raise UnsupportedModelError(
        f"{source}: GGUF rope scaling {scaling!r} (or a rope_freqs tensor) is not supported; "
        "load the Hugging Face checkpoint for Llama-3.1-style scaling"
    )


def _find_tensor(reader: GGUFFile, name: str):
    return next((t for t in reader.tensors if t.name == name), None)


_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
# Checkpoint projections that one fused module of ours holds: kept as blocks all together or not at all.
_FUSED_GROUPS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def plan_native_weights(reader: GGUFFile, why_not: str | None) -> frozenset[str]:
    """The HF names of the weights to keep as raw blocks: 2-D weights (and each expert of a 3-D
    one) of a type with a kernel (quant.h), never a router's, unless `why_not` says why none can be
    (quantization none, no kernels...). Logs one line per tensor type: native kernel, or
    de-quantized and why."""
    groups: dict[str, list[tuple[str, bool]]] = {}
    for tensor in reader.tensors:
        experts = _expert_names(tensor.name, tensor)
        for hf_name in experts or [_hf_name(tensor.name, reader.architecture)]:
            if hf_name is None or not hf_name.endswith(".weight") or is_router_weight(hf_name):
                continue
            native = why_not is None and int(tensor.tensor_type) in NATIVE_TYPES and len(tensor.shape) == 2 + bool(experts)
            group = next((f"{hf_name.split(p)[0]}{g}" for p, g in _FUSED_GROUPS.items() if f".{p}." in hf_name), hf_name)
            groups.setdefault(group, []).append((hf_name, native))
    kept = frozenset(n for members in groups.values() if all(ok for _, ok in members) for n, _ in members)
    by_type: dict[gguf.GGMLQuantizationType, list[tuple[GGUFTensor, bool]]] = {}
    for tensor in reader.tensors:
        names = _expert_names(tensor.name, tensor) or [_hf_name(tensor.name, reader.architecture)]
        by_type.setdefault(tensor.tensor_type, []).append((tensor, all(n in kept for n in names)))
    for qtype, members in sorted(by_type.items()):
        flags = [ok for _, ok in members]
        if all(flags):
            log.info("GGUF tensors run on the quantized kernels", type=qtype.name, tensors=len(flags))
            continue
        if qtype in _FLOAT_TYPES:
            reason = "a float type"
        elif int(qtype) not in NATIVE_TYPES:
            reason = "no kernel for this type"
        else:
            reason = why_not or "1-D, a router's, or fused with a tensor of a type without a kernel"
        if int(qtype) in NATIVE_TYPES or qtype in _FLOAT_TYPES or why_not is not None:
            log.info("GGUF tensors de-quantized", type=qtype.name, tensors=len(flags) - sum(flags), reason=reason)
            continue
        # A type the kernels cannot read: its weights become 16-bit floats, which every token then
        # reads in full; say so, with the cost, rather than run slower without a word.
        lost = [t for t, ok in members if not ok and len(t.shape) == 2]
        file_mib = sum(t.n_bytes for t in lost) / 2**20
        wide_mib = sum(2 * int(np.prod(t.shape)) for t in lost) / 2**20
        log.warning("GGUF tensors de-quantized: no kernel reads this type, so each token reads these weights "
                    "as 16-bit floats", type=qtype.name, tensors=len(flags) - sum(flags), file_mib=round(file_mib, 1),
                    bf16_mib=round(wide_mib, 1), names=[t.name for t in lost][:8])  # fmt: skip
    return kept


def native_nbytes(reader: GGUFFile, native: frozenset[str]) -> int:
    """Bytes a `WeightArena` needs for the raw blocks of the tensors named in `native`."""
    from cadenza.models.weight_arena import aligned

    total = 0
    for tensor in reader.tensors:
        experts = _expert_names(tensor.name, tensor)
        if experts and experts[0] in native:
            total += len(experts) * aligned(tensor.n_bytes // len(experts))
        elif not experts and _hf_name(tensor.name, reader.architecture) in native:
            total += aligned(tensor.n_bytes)
    return total


def iter_gguf_weights(
    reader: GGUFFile, cfg: ModelArchConfig, dtype: torch.dtype, source: str, native: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Every tensor under its HF name: de-quantized to `dtype`, or for the names in `native`
    (see `plan_native_weights`) as raw blocks, read-only views of the file's memory map that the
    model copies where they belong (q/k rows re-ordered: copies). Once the consumer is done with
    a tensor, the map's pages up to it are dropped from resident memory (`GGUFFile.release`)."""
    permute = read_field(reader, "general.architecture") in _PERMUTED_ARCHS
    for tensor in reader.tensors:
        experts = _expert_names(tensor.name, tensor)
        if experts:
            yield from _expert_weights(tensor, experts, dtype, source, native)
            reader.release(tensor)
            continue
        if tensor.name in _CONFIG_TENSORS:
            continue
        hf_name = _hf_name(tensor.name, reader.architecture)
        if hf_name is None:
            raise UnsupportedModelError(f"{source}: unexpected tensor {tensor.name!r}")
        if hf_name in native:
            yield hf_name, _raw_blocks(tensor, hf_name, cfg, permute)
            reader.release(tensor)
            continue
        weight = torch.from_numpy(_dequantize(tensor, source))
        if permute and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute(weight, cfg.num_heads)
        elif permute and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute(weight, cfg.num_kv_heads)
        yield hf_name, weight.to(torch.float32 if is_router_weight(hf_name) else dtype)
        reader.release(tensor)


def _expert_weights(tensor, names: list[str], dtype: torch.dtype, source: str, native: frozenset[str]
                    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Each expert's slice of a 3-D expert tensor (or of a 2-D tensor of their biases): raw blocks
    (a view of the file) or de-quantized, one expert at a time (a whole layer's experts
    de-quantized at once would be gigabytes)."""
    in_features = int(tensor.shape[0])
    for expert, hf_name in enumerate(names):
        data = tensor.data[expert]
        if len(tensor.shape) == 2:  # biases [experts, out]
            yield hf_name, torch.from_numpy(_dequantize_array(data, tensor.tensor_type, tensor.name, source)).to(dtype)
            continue
        if hf_name in native:
            with warnings.catch_warnings():  # a view of the read-only map: nothing writes to it
                warnings.simplefilter("ignore", UserWarning)
                yield hf_name, QuantizedTensor(torch.from_numpy(data), int(tensor.tensor_type), in_features)
        else:
            values = _dequantize_array(data, tensor.tensor_type, tensor.name, source)
            yield hf_name, torch.from_numpy(values.reshape(int(tensor.shape[1]), in_features)).to(dtype)


def _expert_names(name: str, tensor) -> list[str] | None:
    """The per-expert checkpoint names a 3-D expert tensor holds, in expert order; None for any
    other tensor."""
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match.group(2) not in _EXPERT_NAMES:
        return None
    layer, part, kind = match.groups()
    if len(tensor.shape) != (3 if kind == "weight" else 2):
        return None
    experts = int(tensor.shape[-1])
    return [f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_NAMES[part]}.{kind}" for e in range(experts)]


def _raw_blocks(tensor, hf_name: str, cfg: ModelArchConfig, permute: bool) -> QuantizedTensor:
    rows, in_features = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists dimensions fastest-first
    with warnings.catch_warnings():  # a view of the read-only map: nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(tensor.data.reshape(rows, -1))
    # Rows are independent: undoing llama.cpp's q/k row interleaving moves whole rows of blocks.
    if permute and hf_name.endswith("q_proj.weight"):
        blocks = _unpermute(blocks, cfg.num_heads).contiguous()
    elif permute and hf_name.endswith("k_proj.weight"):
        blocks = _unpermute(blocks, cfg.num_kv_heads).contiguous()
    return QuantizedTensor(blocks, int(tensor.tensor_type), in_features)


def _hf_name(name: str, arch: str = "llama") -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if match is None or match.group(2) not in names:
        return None
    layer, part, kind = match.groups()
    if names[part] in _BARE_PARAMETERS:
        return f"model.layers.{layer}.{names[part]}"
    return f"model.layers.{layer}.{names[part]}.{kind}"


def _dequantize(tensor, source: str) -> np.ndarray:
    # GGUF lists dimensions fastest-first; numpy (and HF) want them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return _dequantize_array(tensor.data, tensor.tensor_type, tensor.name, source).reshape(shape)


def _dequantize_array(data: np.ndarray, qtype, name: str, source: str) -> np.ndarray:
    """`data` (a tensor's, or a slice of whole rows of it) as float32 values."""
    if qtype not in SUPPORTED_QUANT_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_QUANT_TYPES))
        raise UnsupportedModelError(f"{source}: tensor {name!r} uses quantization {qtype.name}; supported: {supported}")
    if qtype == gguf.GGMLQuantizationType.MXFP4:
        from cadenza.models.mxfp4 import dequantize_mxfp4

        return dequantize_mxfp4(torch.from_numpy(np.array(data, dtype=np.uint8))).numpy()
    # A copy: F32/F16 tensors come back as views of the read-only memory map.
    return np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of the rotary halves (rows of q or k)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
