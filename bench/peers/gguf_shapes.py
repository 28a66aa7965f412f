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

from cadenza.bench.peers.llamacpp_build import cache_root, find_binary, why_binaries_missing

_INIT_STD = 0.02  # transformers' initializer_range: weights of a trained model's scale


def gguf_dir() -> Path:
    return cache_root().parent / "gguf"


def _config(shape: str):
    from cadenza.models.dummy import read_dummy_arch

    arch, _ = read_dummy_arch(shape)
    return arch


def _tokenizer_fields():
    """The default model's `tokenizer.*` metadata, as (key, value, type, sub-type) to write again."""
    import gguf

    from cadenza.models.default_model import default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            yield field.name, field.contents(), field.types[0], sub


def _tensors(arch, vocab: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(llama.cpp name, shape rows-first, is a norm) of every tensor of `arch`."""
    h, q, kv, inter = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    out = [("token_embd.weight", (vocab, h), False), ("output_norm.weight", (h,), True)]
    if not arch.tie_word_embeddings:
        out.append(("output.weight", (vocab, h), False))
    for i in range(arch.num_layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,), True), (b + "attn_q.weight", (q, h), False),
                (b + "attn_k.weight", (kv, h), False), (b + "attn_v.weight", (kv, h), False),
                (b + "attn_output.weight", (h, q), False), (b + "ffn_norm.weight", (h,), True),
                (b + "ffn_gate.weight", (inter, h), False), (b + "ffn_up.weight", (inter, h), False),
                (b + "ffn_down.weight", (h, inter), False)]  # fmt: skip
    return out


def write_shape_gguf(shape: str, path: Path, seed: int = 0) -> Path:
    """Write `shape` as an F16 GGUF at `path` (tensor by tensor); returns `path`."""
    import gguf

    arch = _config(shape)
    fields = list(_tokenizer_fields())
    vocab = len(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"))
    tensors = _tensors(arch, vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # renamed when whole: a killed write leaves no torn file
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_name(f"{shape} (random weights)")
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
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in fields:
        writer.add_key_value(key, value, vtype, sub)
    for name, dims, norm in tensors:
        dtype = np.float32 if norm else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, norm in tensors:
        if norm:
            data = np.ones(dims, dtype=np.float32)
        else:
            data = (rng.standard_normal(dims, dtype=np.float32) * _INIT_STD).astype(np.float16)
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


def shape_gguf(shape: str, quant: str = "F16", seed: int = 0) -> Path:
    """The cached GGUF of `shape` in `quant` (F16, or a llama-quantize type such as Q4_K_M), written
    and quantized on first use."""
    f16 = gguf_dir() / f"{shape}-random{seed}-F16.gguf"
    if not f16.is_file():
        write_shape_gguf(shape, f16, seed)
    if quant.upper() == "F16":
        return f16
    path = gguf_dir() / f"{shape}-random{seed}-{quant.upper()}.gguf"
    return path if path.is_file() else quantize(f16, quant.upper(), path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, help="a shipped shape (config/shapes/), e.g. llama-3.2-1b")
    parser.add_argument("--quant", default="F16", help="F16, or a llama-quantize type (Q4_K_M, Q6_K, IQ4_XS, ...)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(shape_gguf(args.shape, args.quant, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
