"""GGUF files of real model shapes with random weights, nothing downloaded: what the benches run at
the sizes people use, on cadenza and llama.cpp alike.

`write_shape_gguf` writes a shipped shape (config/shapes/, e.g. `llama-3.2-1b`) as an F16 GGUF:
llama.cpp's tensor names and metadata, random weights (normal, 0.02, as transformers initialises),
and the embedded default model's tokenizer (SmolLM2's 49,152 tokens, so the vocabulary, embedding
and LM head are that size, not the shape's). `quantize` then runs llama.cpp's own `llama-quantize`
on it (built by `python -m cadenza.bench.peers.llamacpp_build`), so a Q4_K_M file is exactly what
users download, tensor types and all. Files are cached outside the repository, beside llama.cpp's
build (`~/.cache/cadenza/gguf/`).

    python -m cadenza.bench.peers.gguf_shapes --shape llama-3.2-1b --quant Q4_K_M   # prints the path
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import numpy as np

from cadenza.bench.peers.llamacpp_build import cache_root, find_binary, locked, why_binaries_missing

_INIT_STD = 0.02  # transformers' initializer_range: weights of a trained model's scale


def gguf_dir() -> Path:
    return cache_root().parent / "gguf"


# The families whose tensors this writes (their GGUF names: models/families.py).
_WRITES = ("llama", "qwen3", "qwen3_moe", "gpt_oss")


def _gguf_arch(model_type: str) -> str:
    from cadenza.models.families import GGUF_ARCHITECTURES

    return next(arch for arch, family in GGUF_ARCHITECTURES.items() if family == model_type)


def _config(shape: str, layers: int | None = None):
    """The shape's architecture; with `layers`, its first `layers` decoder layers only (a
    mixture of experts too large for this machine keeps its real layer shape, fewer of them)."""
    from dataclasses import replace

    from cadenza.models.dummy import read_dummy_arch

    arch, _ = read_dummy_arch(shape)
    if arch.model_type not in _WRITES:
        raise ValueError(f"shape {shape}: writing a {arch.model_type} GGUF is not supported; "
                         f"supported: {', '.join(_WRITES)}")
    if layers is None or layers == arch.num_layers:
        return arch
    if not 0 < layers < arch.num_layers:
        raise ValueError(f"shape {shape} has {arch.num_layers} layers; cannot keep {layers}")
    moe = arch.moe and replace(arch.moe, layers=tuple(i for i in arch.moe.layers if i < layers))
    return replace(arch, num_layers=layers, moe=moe)


def _tokenizer_fields():
    """The default model's `tokenizer.*` metadata, as (key, value, type, sub-type) to write again."""
    import gguf

    from cadenza.models.default_model import default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            yield field.name, field.contents(), field.types[0], sub


# Written as float32 with random values: routers (llama-quantize leaves them float32), biases and
# sinks (it quantizes only `.weight` matrices).
_FLOAT32 = ("ffn_gate_inp.weight", ".bias", "attn_sinks.weight")


def _tensors(arch, vocab: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(llama.cpp name, shape rows-first, is a norm) of every tensor of `arch`."""
    h, q, kv, inter = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    out = [("token_embd.weight", (vocab, h), False), ("output_norm.weight", (h,), True)]
    if not arch.tie_word_embeddings:
        out.append(("output.weight", (vocab, h), False))
    gpt_oss = arch.model_type == "gpt_oss"
    for i in range(arch.num_layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,), True), (b + "attn_q.weight", (q, h), False),
                (b + "attn_k.weight", (kv, h), False), (b + "attn_v.weight", (kv, h), False),
                (b + "attn_output.weight", (h, q), False),
                (b + ("post_attention_norm.weight" if gpt_oss else "ffn_norm.weight"), (h,), True)]  # fmt: skip
        if arch.qkv_bias:
            out += [(b + "attn_q.bias", (q,), False), (b + "attn_k.bias", (kv,), False), (b + "attn_v.bias", (kv,), False)]
        if arch.o_bias:
            out.append((b + "attn_output.bias", (h,), False))
        if arch.attention_sinks:
            out.append((b + "attn_sinks.weight", (arch.num_heads,), False))
        if arch.qk_norm:
            out += [(b + "attn_q_norm.weight", (arch.head_dim,), True), (b + "attn_k_norm.weight", (arch.head_dim,), True)]
        if arch.moe is not None and i in arch.moe.layers:
            n, width = arch.moe.num_experts, arch.moe.intermediate_size
            out += [(b + "ffn_gate_inp.weight", (n, h), False), (b + "ffn_gate_exps.weight", (n, width, h), False),
                    (b + "ffn_up_exps.weight", (n, width, h), False), (b + "ffn_down_exps.weight", (n, h, width), False)]
            if arch.moe.router_bias:
                out.append((b + "ffn_gate_inp.bias", (n,), False))
            if arch.mlp_bias:
                out += [(b + "ffn_gate_exps.bias", (n, width), False), (b + "ffn_up_exps.bias", (n, width), False),
                        (b + "ffn_down_exps.bias", (n, h), False)]
        else:
            out += [(b + "ffn_gate.weight", (inter, h), False), (b + "ffn_up.weight", (inter, h), False),
                    (b + "ffn_down.weight", (h, inter), False)]
    return out


def write_shape_gguf(shape: str, path: Path, seed: int = 0, layers: int | None = None) -> Path:
    """Write `shape` (its first `layers` layers) as an F16 GGUF at `path` (tensor by tensor);
    returns `path`."""
    import gguf

    arch = _config(shape, layers)
    fields = list(_tokenizer_fields())
    vocab = len(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"))
    tensors = _tensors(arch, vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # renamed when whole: a killed write leaves no torn file
    writer = gguf.GGUFWriter(str(partial), _gguf_arch(arch.model_type))
    writer.add_name(f"{shape} (random weights{'' if layers is None else f', {arch.num_layers} layers'})")
    writer.add_context_length(min(arch.max_position_embeddings, 8192))
    writer.add_embedding_length(arch.hidden_size)
    writer.add_block_count(arch.num_layers)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_heads)
    writer.add_head_count_kv(arch.num_kv_heads)
    writer.add_key_length(arch.head_dim)
    writer.add_value_length(arch.head_dim)
    writer.add_rope_dimension_count(arch.head_dim)
    writer.add_rope_freq_base(arch.rope.theta)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    writer.add_vocab_size(vocab)
    if arch.moe is not None:
        writer.add_expert_count(arch.moe.num_experts)
        writer.add_expert_used_count(arch.moe.top_k)
        writer.add_expert_feed_forward_length(arch.moe.intermediate_size)
        writer.add_expert_weights_norm(arch.moe.normalize_top_k)
    if arch.layer_windows is not None:
        writer.add_sliding_window(next(w for w in arch.layer_windows if w is not None))
    if arch.rope.rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(arch.rope.factor)
        writer.add_rope_scaling_orig_ctx_len(arch.rope.original_max_position_embeddings)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in fields:
        writer.add_key_value(key, value, vtype, sub)
    for name, dims, norm in tensors:
        dtype = np.float32 if norm or name.endswith(_FLOAT32) else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, norm in tensors:
        if norm:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        elif name.endswith(_FLOAT32):
            writer.write_tensor_data(rng.standard_normal(dims, dtype=np.float32) * _INIT_STD)
        else:  # a slice at a time: a layer's experts are billions of values
            data = np.empty(dims, dtype=np.float16)
            for row in range(dims[0]):
                data[row] = rng.standard_normal(dims[1:], dtype=np.float32) * _INIT_STD
            writer.write_tensor_data(data)
    writer.close()
    partial.rename(path)
    return path


def quantize(source: Path, quant: str, path: Path, threads: int | None = None) -> Path:
    """llama.cpp's `llama-quantize source path quant` (its own tensor-type choices for the mix)."""
    why = why_binaries_missing()
    binary = find_binary("llama-quantize")
    if why or binary is None:
        raise ValueError(f"cannot quantize {source.name} to {quant}: {why or 'llama-quantize is not built'}")
    partial = path.with_name(path.name + ".partial")
    command = [str(binary), str(source), str(partial), quant]
    if threads:
        command.append(str(threads))
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    partial.rename(path)
    return path


def shape_gguf(shape: str, quant: str = "F16", seed: int = 0, layers: int | None = None) -> Path:
    """The cached GGUF of `shape` (its first `layers` layers) in `quant` (F16, or a llama-quantize
    type such as Q4_K_M), written and quantized on first use."""
    stem = shape if layers is None else f"{shape}-{layers}layers"
    f16 = gguf_dir() / f"{stem}-random{seed}-F16.gguf"
    path = f16 if quant.upper() == "F16" else gguf_dir() / f"{stem}-random{seed}-{quant.upper()}.gguf"
    if path.is_file():
        return path
    gguf_dir().mkdir(parents=True, exist_ok=True)
    # One writer per file: a second bench started meanwhile waits for the first's file.
    with locked(gguf_dir() / f".{stem}.lock"):
        if not f16.is_file():
            write_shape_gguf(shape, f16, seed, layers)
        return path if path.is_file() else quantize(f16, quant.upper(), path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, help="a shipped shape (config/shapes/), e.g. llama-3.2-1b")
    parser.add_argument("--quant", default="F16", help="F16, or a llama-quantize type (Q4_K_M, Q6_K, IQ4_XS, ...)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, help="keep only the first N decoder layers (real layer shapes, fewer)")
    args = parser.parse_args(argv)
    print(shape_gguf(args.shape, args.quant, args.seed, args.layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
