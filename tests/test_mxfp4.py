"""MXFP4 (GGML type 39), gpt-oss's expert weights: the PyTorch de-quantizer and layouts of
models/mxfp4.py, and the kernels over its blocks (kernels/cpu/quant.h, quant_packed.h).

De-quantizing is exact (powers of two times integers of at most 12), so de-quantizers are compared
bit for bit: ours with the `gguf` package's reference, the kernels' with ours, a Hugging Face
checkpoint's blocks re-laid for GGUF with transformers' own de-quantizer, and bytes llama.cpp's
`llama-quantize` wrote with `gguf`'s reading of them. Products are checked against a float64
product of the de-quantized weights with test_quantized.py's tolerance (the int8 rounding of the
activations: 6 sigma of its error, plus float32 accumulation).
"""

from __future__ import annotations

import math
import os
import subprocess

import gguf
import numpy as np
import pytest
import torch

from cadenza.kernels.cpu.features import cpu_has_avx2_fma
from cadenza.models.mxfp4 import DOUBLED_VALUES, dequantize_mxfp4, mxfp4_from_hf, quantize_mxfp4_hf

MXFP4 = 39
PACKED = MXFP4 + 256
kernel_test = pytest.mark.skipif(not cpu_has_avx2_fma(), reason="the quantized kernels need x86-64 with AVX2 and FMA")


def random_blocks(rows: int, cols: int, rng: np.random.Generator, exponents=(122, 128)) -> torch.Tensor:
    """Random GGUF MXFP4 blocks [rows, cols / 32 * 17], exponents in [low, high): weights of at most
    12 * 2^(high - 129) (6 by default), as test_quantized.py's other types."""
    blocks = rng.integers(0, 256, size=(rows, cols // 32, 17), dtype=np.uint8)
    blocks[:, :, 0] = rng.integers(*exponents, size=(rows, cols // 32))
    return torch.from_numpy(blocks.reshape(rows, -1))


def reference(blocks: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W^T in float64, the tolerance of each output) for W the de-quantized blocks, as
    test_quantized.py's `reference`."""
    w = dequantize_mxfp4(blocks).double()
    x64 = x.double()
    half_step = x64.abs().reshape(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1) / 254
    sigma = (half_step.square() @ w.square().T / 3).sqrt()
    return x64 @ w.T, 6 * sigma + 1e-5 * (x64.abs() @ w.abs().T) + 1e-4


def within(got: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> bool:
    return bool(((got.double() - expected).abs() <= tol).all())


# --- the PyTorch side -------------------------------------------------------------------------------


def test_dequantize_matches_the_gguf_reference():
    blocks = random_blocks(24, 256, np.random.default_rng(0), exponents=(100, 150))
    expected = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.MXFP4)
    got = dequantize_mxfp4(blocks)
    assert got.dtype == torch.float32 and got.shape == (24, 256)
    assert torch.equal(got, torch.from_numpy(expected))


SPECIAL_EXPONENTS = (0, 1, 2, 127, 200, 254)  # the two denormal scales, the first normal one, 1/2, large, the largest


def special_blocks(e: int, rows: int = 16, cols: int = 64) -> torch.Tensor:
    """Blocks of exponent e whose nibbles run through every index."""
    count = rows * cols // 32 * 17
    blocks = torch.arange(count, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(rows, -1, 17)
    blocks[:, :, 0] = e
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("e", SPECIAL_EXPONENTS)
def test_special_exponents_dequantize_exactly(e):
    """2^(e - 128) times each doubled E2M1 value, computed in float64 and rounded once: exact for the
    denormal scales (e = 0, 1), infinite for e = 254 where |value| >= 4 (12 * 2^126 > float32's max)."""
    blocks = special_blocks(e)
    got = dequantize_mxfp4(blocks)
    raw = blocks.reshape(16, -1, 17)
    index = torch.cat([raw[..., 1:] & 0x0F, raw[..., 1:] >> 4], dim=-1).reshape(16, -1)
    table = torch.tensor([math.ldexp(v, e - 128) for v in DOUBLED_VALUES], dtype=torch.float64)
    assert torch.equal(got, table[index.long()].float())
    if e < 2:
        # The scale itself a denormal, not flushed to 0.
        assert got[got != 0].abs().min().item() == math.ldexp(1.0, e - 128) < torch.finfo(torch.float32).tiny
    assert torch.isinf(got).any() == (e == 254)


def test_hf_blocks_relaid_for_gguf_dequantize_as_transformers_does():
    """`mxfp4_from_hf` against transformers' de-quantizer of a gpt-oss checkpoint's experts
    (blocks [experts, rows, n, 16], scales [experts, rows, n]; it returns [experts, in, out])."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(100, 150, (3, 8, 4), dtype=torch.uint8, generator=generator)
    scales[0, 0] = torch.tensor([0, 1, 2, 254], dtype=torch.uint8)  # ggml and transformers agree below 255
    gguf_blocks = mxfp4_from_hf(blocks, scales)
    assert gguf_blocks.shape == (3, 8, 4 * 17) and torch.equal(gguf_blocks.reshape(3, 8, 4, 17)[..., 0], scales)
    expected = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(dequantize_mxfp4(gguf_blocks), expected)


def test_the_reference_quantizer_fits_each_block_and_rounds_to_nearest():
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(6, 4, 128, generator=generator) * torch.logspace(-30, 3, 4).reshape(1, 4, 1)
    w[0, 0, :32] = 0.0  # an all-zero block
    blocks, scales = quantize_mxfp4_hf(w)
    assert blocks.shape == (6, 4, 4, 16) and scales.shape == (6, 4, 4)
    assert blocks.dtype == scales.dtype == torch.uint8
    got = dequantize_mxfp4(mxfp4_from_hf(blocks, scales)).reshape(6, 4, 4, 32).double()
    groups = w.double().reshape(6, 4, 4, 32)
    scale = torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    amax = groups.abs().amax(-1, keepdim=True)
    # The smallest exponent that fits: 6 * scale holds max |w|, half of it would not (or it is 0).
    assert (amax <= 6 * scale).all() and ((amax > 3 * scale) | (scales.unsqueeze(-1) == 0)).all()
    # Nearest: off by at most half the gap to the next value (0.5, 1 or 2 times the scale).
    gap = torch.where(groups.abs() < 2 * scale, 0.5, torch.where(groups.abs() < 4 * scale, 1.0, 2.0)) * scale
    assert ((got - groups).abs() <= gap / 2).all()
    assert torch.equal(got[0, 0, 0], torch.zeros(32, dtype=torch.float64))
    # Values already on the grid come back as they are (the bytes may differ: a block whose largest
    # value is small takes a smaller exponent).
    again = dequantize_mxfp4(mxfp4_from_hf(*quantize_mxfp4_hf(got.float().reshape(6, 4, 128))))
    assert torch.equal(again, got.float().reshape(6, 4, 128))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="17-byte"):
        dequantize_mxfp4(torch.zeros(2, 18, dtype=torch.uint8))
    with pytest.raises(ValueError, match="blocks"):
        mxfp4_from_hf(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="32-value"):
        quantize_mxfp4_hf(torch.zeros(2, 40))


# --- the kernels --------------------------------------------------------------------------------


@kernel_test
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_products_in_the_files_layout_match_the_float64_reference(kernels, rows):
    rng = np.random.default_rng(rows)
    cols, out_features = 768, 37  # not a multiple of the tile (16) or of the rows per pass
    w = random_blocks(out_features, cols, rng)
    x = torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32))
    expected, tol = reference(w, x)
    assert kernels.quant_in_features(w, MXFP4) == cols
    got = kernels.quant_linear(x, w, MXFP4, None)
    assert got.shape == (rows, out_features) and within(got, expected, tol)
    bias = torch.from_numpy(rng.standard_normal(out_features, dtype=np.float32))
    residual = torch.from_numpy(rng.standard_normal((rows, out_features), dtype=np.float32))
    summed = kernels.quant_linear_add_(residual.clone(), x, w, MXFP4, bias)
    assert within(summed, residual.double() + expected + bias.double(), tol + 1e-5)


@kernel_test
def test_packed_products_match_the_reference_and_the_files_layout(kernels):
    """quant_packed.h's PackMXFP4: a group-block is the rows' E8M0 bytes then 4 chunks of nibbles,
    as many bytes as the file's. Every row the same alone or in a batch of any size."""
    assert kernels.quant_packs(MXFP4)
    group = kernels.pack_rows()
    rng = np.random.default_rng(11)
    cols, out_features = 768, 48  # 3 groups of 16, 6 of 8
    w = random_blocks(out_features, cols, rng)
    packed = kernels.quant_pack(w, MXFP4)
    assert packed.shape == w.shape and kernels.quant_in_features(packed, PACKED) == cols
    # Group-block 0 starts with the group's exponent bytes, one a row.
    assert torch.equal(packed[0, :group], w[:group, 0]) and not torch.equal(packed[:group], w[:group])
    x = torch.from_numpy(rng.standard_normal((17, cols), dtype=np.float32))
    expected, tol = reference(w, x)
    got = kernels.quant_linear(x, packed, PACKED, None)
    assert within(got, expected, tol)
    assert within(kernels.quant_linear(x, w, MXFP4, None), expected, tol)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16):  # passes of 4 or 8 rows
        assert torch.equal(kernels.quant_linear(x[:rows].clone(), packed, PACKED, None), got[:rows])
    bias = torch.from_numpy(rng.standard_normal(out_features, dtype=np.float32))
    residual = torch.from_numpy(rng.standard_normal((17, out_features), dtype=np.float32))
    summed = kernels.quant_linear_add_(residual.clone(), x, packed, PACKED, bias)
    assert torch.equal(summed, residual + kernels.quant_linear(x, packed, PACKED, bias))
    wide = torch.zeros(17, out_features + 5)  # a column slice of a wider output
    kernels.quant_matmul_(wide[:, 2 : 2 + out_features], x, packed, PACKED, None, False)
    assert torch.equal(wide[:, 2 : 2 + out_features], got) and not wide[:, :2].any() and not wide[:, -3:].any()
    with pytest.raises(RuntimeError, match=f"multiple of {group}"):
        kernels.quant_pack(w[: group + 4].contiguous(), MXFP4)


@kernel_test
def test_products_hold_at_the_extremes_of_their_integer_sums(kernels):
    """Every value +-12 against activations at +-127: no int16 pair of AVX2's vpmaddubsw saturates."""
    rng = np.random.default_rng(5)
    cols, out_features = 512, 2 * kernels.pack_rows()
    w = random_blocks(out_features, cols, rng).reshape(out_features, -1, 17)
    w[: out_features // 2, :, 1:] = 0x77  # 12
    w[out_features // 2 :, :, 1:] = 0xFF  # -12
    w = w.reshape(out_features, -1)
    x = torch.from_numpy(np.where(rng.random((3, cols)) < 0.5, -1.0, 1.0).astype(np.float32))
    x[1] = 1.0  # sums of one sign only
    expected, tol = reference(w, x)
    for blocks, qtype in ((w, MXFP4), (kernels.quant_pack(w, MXFP4), PACKED)):
        assert within(kernels.quant_linear(x, blocks, qtype, None), expected, tol)


@kernel_test
@pytest.mark.parametrize("e", SPECIAL_EXPONENTS)
def test_special_exponents_through_the_kernels(kernels, e):
    """Blocks of exponent e de-quantize through the kernels exactly as `dequantize_mxfp4` (file's
    layout and packed, float32 and bfloat16), and their products hold to the tolerance once divided by
    the scale. For e = 254 the values stay within +-3 (finite) and the activations small (2^-20),
    so that no product overflows; scaling x by a power of two changes none of its int8 rounding."""
    blocks = special_blocks(e, rows=2 * kernels.pack_rows(), cols=256)
    if e == 254:
        raw = blocks.reshape(blocks.shape[0], -1, 17)
        raw[..., 1:] &= 0x33  # indices 0-3: values 0-3
    exact = dequantize_mxfp4(blocks)
    packed = kernels.quant_pack(blocks, MXFP4)
    ids = torch.tensor([0, 5, blocks.shape[0] - 1])
    for w, qtype in ((blocks, MXFP4), (packed, PACKED)):
        assert torch.equal(kernels.quant_dequantize(w, qtype), exact)
        assert torch.equal(kernels.quant_rows(w, qtype, ids), exact[ids])
        as_bf16 = kernels.quant_dequantize_(torch.empty(exact.shape, dtype=torch.bfloat16), w, qtype)
        assert torch.equal(as_bf16, exact.bfloat16())
    x = torch.from_numpy(np.random.default_rng(e).standard_normal((5, 256), dtype=np.float32))
    scale_x = 2.0**-20 if e == 254 else 1.0
    integers = blocks.reshape(blocks.shape[0], -1, 17).clone()
    integers[..., 0] = 129  # the same values at scale 2
    integers = integers.reshape(blocks.shape[0], -1)
    expected, tol = reference(integers, x)
    # The kernels scale each block's integer sum by 2^(e - 128) times the activation's scale, a
    # float32 product that keeps fewer bits where it is denormal (e = 0, 1: about 15 of 24 here).
    if e < 2:
        tol = tol + 2.0**-12 * (x.double().abs() @ dequantize_mxfp4(integers).double().abs().T)
    to_integers = 2.0 ** (129 - e) / scale_x  # exact: powers of two
    for w, qtype in ((blocks, MXFP4), (packed, PACKED)):
        got = kernels.quant_linear(x * scale_x, w, qtype, None).double() * to_integers
        assert within(got, expected, tol)


@kernel_test
def test_long_steps_match_the_reference(kernels):
    """A prefill-sized step through the int8 kernels, in chunks of rows (4096 inputs: 32 rows a chunk)."""
    rng = np.random.default_rng(3)
    w = random_blocks(32, 4096, rng)
    x = torch.from_numpy(rng.standard_normal((70, 4096), dtype=np.float32))
    expected, tol = reference(w, x)
    for blocks, qtype in ((w, MXFP4), (kernels.quant_pack(w, MXFP4), PACKED)):
        got = kernels.quant_linear(x, blocks, qtype, None)
        assert within(got, expected, tol)
        for row in (0, 31, 32, 69):
            assert torch.equal(kernels.quant_linear(x[row : row + 1].clone(), blocks, qtype, None), got[row : row + 1])


@kernel_test
@pytest.mark.parametrize("out_features", [48, 36])  # packed; 36 rows: the file's layout in every build
def test_gemm_steps_match_the_reference(kernels, out_features):
    """`QuantizedLinear`'s de-quantized GEMM (bfloat16 where the CPU multiplies it natively), which
    a step takes from the linear's `min_rows` on, and the int8 kernels below it."""
    from cadenza.models.quantized_linear import NATIVE_TYPES, QuantizedLinear, QuantizedTensor

    assert NATIVE_TYPES[MXFP4] == ("MXFP4", 32, 17)
    rng = np.random.default_rng(out_features)
    cols = 256
    w = random_blocks(out_features, cols, rng)
    linear = QuantizedLinear(cols, out_features, bias=False)
    linear.load_rows(0, QuantizedTensor(w, MXFP4, cols))
    linear.finish_loading()
    linear.use_cpu_kernels(kernels)
    qtype = PACKED if out_features % kernels.pack_rows() == 0 else MXFP4
    assert linear.parts == [(0, qtype)] and "MXFP4" in linear.extra_repr()
    x = torch.from_numpy(rng.standard_normal((linear.min_rows, cols), dtype=np.float32))
    assert linear._uses_gemm(x)
    expected, tol = reference(w, x)
    with torch.no_grad():
        assert within(linear(x), expected, tol)
        residual = torch.from_numpy(rng.standard_normal((x.shape[0], out_features), dtype=np.float32))
        assert within(linear.linear_add_(residual.clone(), x), residual.double() + expected, tol + 1e-5)
        assert within(linear(x[:3]), expected[:3], tol[:3])


@kernel_test
def test_an_embedding_of_mxfp4_rows(kernels):
    from cadenza.models.quantized_linear import QuantizedEmbedding, QuantizedTensor

    w = random_blocks(32, 64, np.random.default_rng(4))
    embedding = QuantizedEmbedding(32, 64)
    embedding.load_rows(0, QuantizedTensor(w, MXFP4, 64))
    embedding.finish_loading()
    embedding.use_cpu_kernels(kernels)
    ids = torch.tensor([[3, 0], [31, 3]])
    assert torch.equal(embedding(ids), dequantize_mxfp4(w)[ids])


@kernel_test
@pytest.mark.parametrize("packed", [False, True])
def test_the_experts_kernel_runs_mxfp4_experts(kernels, packed):
    """kernels/cpu/moe.h over MXFP4 experts gives what each expert's products one by one give, and
    the float64 mixture within a loose bound."""
    rng = np.random.default_rng(6)
    hidden, inter, experts, top_k = 64, 96, 4, 2
    gate_up = [random_blocks(2 * inter, hidden, rng, exponents=(118, 121)) for _ in range(experts)]
    down = [random_blocks(hidden, inter, rng, exponents=(118, 121)) for _ in range(experts)]
    if packed:
        gate_up, down = [kernels.quant_pack(w, MXFP4) for w in gate_up], [kernels.quant_pack(w, MXFP4) for w in down]
    qtype = PACKED if packed else MXFP4
    moe = kernels.MoEKernel(gate_up, [qtype] * experts, down, [qtype] * experts, hidden)
    for tokens in (1, 5):
        x = torch.from_numpy(rng.standard_normal((tokens, hidden), dtype=np.float32))
        residual = torch.from_numpy(rng.standard_normal((tokens, hidden), dtype=np.float32))
        ids = torch.from_numpy(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])).long()
        weights = torch.from_numpy(rng.random((tokens, top_k), dtype=np.float32))
        got = moe.add_(residual.clone(), x, ids, weights)
        one_by_one, exact = residual.clone(), residual.double()
        for t in range(tokens):
            for j in range(top_k):
                e, weight = int(ids[t, j]), float(weights[t, j])
                h = kernels.silu_mul(kernels.quant_linear(x[t : t + 1].clone(), gate_up[e], qtype, None)) * weight
                one_by_one[t] += kernels.quant_linear(h, down[e], qtype, None)[0]
                g, u = (x[t].double() @ dequantize_mxfp4_of(kernels, gate_up[e], qtype).double().T).split(inter)
                h64 = torch.nn.functional.silu(g) * u * weight
                exact[t] += h64 @ dequantize_mxfp4_of(kernels, down[e], qtype).double().T
        torch.testing.assert_close(got, one_by_one, rtol=1e-5, atol=1e-5)
        # Two products' int8 roundings: a few parts in a thousand of the mixture's output.
        assert (got.double() - exact).norm() < 0.02 * (exact - residual.double()).norm()


def dequantize_mxfp4_of(kernels, w: torch.Tensor, qtype: int) -> torch.Tensor:
    """A weight's values whichever its layout: the file's through `dequantize_mxfp4`, packed through
    the kernels (which the tests above hold equal to it)."""
    return kernels.quant_dequantize(w, qtype) if qtype == PACKED else dequantize_mxfp4(w)


# --- bytes llama.cpp wrote ----------------------------------------------------------------------------


def llama_quantize():
    """llama.cpp's `llama-quantize` of whichever kind was built (bench/peers/llamacpp_build.py), or None."""
    from cadenza.bench.peers.llamacpp_build import version_dir

    found = sorted(version_dir().glob("*/bin/llama-quantize"))
    return found[0] if found else None


def write_tiny_moe_gguf(path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A one-layer Llama-style mixture in float32, as llama-quantize reads it; returns its expert weights."""
    hidden, inter, experts, vocab = 64, 96, 4, 32
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(2)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    ones = np.ones(hidden, dtype=np.float32)
    tensors = {"token_embd.weight": weight(vocab, hidden), "output_norm.weight": ones,
               "output.weight": weight(vocab, hidden), "blk.0.attn_norm.weight": ones, "blk.0.ffn_norm.weight": ones,
               "blk.0.ffn_gate_inp.weight": weight(experts, hidden)}
    tensors.update({f"blk.0.attn_{p}.weight": weight(hidden, hidden) for p in ("q", "k", "v", "output")})
    expert_weights = {"blk.0.ffn_gate_exps.weight": weight(experts, inter, hidden),
                      "blk.0.ffn_up_exps.weight": weight(experts, inter, hidden),
                      "blk.0.ffn_down_exps.weight": weight(experts, hidden, inter)}
    for name, value in {**tensors, **expert_weights}.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expert_weights


@kernel_test
def test_llama_quantize_mxfp4_moe_bytes(kernels, tmp_path):
    """`llama-quantize ... MXFP4_MOE` writes a mixture's experts as MXFP4: our de-quantizer equals
    gguf's on those bytes, the kernels equal ours, and the values are the source's to within
    half a step of each block's grid."""
    binary = llama_quantize()
    if binary is None:
        pytest.skip("llama.cpp's llama-quantize is not built (python -m cadenza.bench.peers.llamacpp_build)")
    source, target = tmp_path / "f32.gguf", tmp_path / "mxfp4.gguf"
    weights = write_tiny_moe_gguf(source, np.random.default_rng(0))
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    subprocess.run([str(binary), str(source), str(target), "MXFP4_MOE"], check=True, env=env, capture_output=True)
    tensors = {t.name: t for t in gguf.GGUFReader(str(target)).tensors}
    for name, value in weights.items():
        tensor = tensors[name]
        assert tensor.tensor_type == gguf.GGMLQuantizationType.MXFP4
        raw = torch.from_numpy(np.array(tensor.data)).reshape(-1, tensor.data.shape[-1])
        ours = dequantize_mxfp4(raw)
        assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.MXFP4)))
        assert torch.equal(kernels.quant_dequantize(raw, MXFP4), ours)
        assert torch.equal(kernels.quant_dequantize(kernels.quant_pack(raw, MXFP4), PACKED), ours)
        source_values = torch.from_numpy(value).reshape(ours.shape).double()
        # ggml's exponent is floor(log2(max |w|)) - 2 + 127, so d = 2^(e - 128) is at least max |w| / 16:
        # values off by at most half the top gap (2d) or clipped to 12d (by up to 4d).
        d = torch.pow(2.0, raw.reshape(raw.shape[0], -1, 17)[..., 0].double() - 128).repeat_interleave(32, dim=1)
        assert ((ours.double() - source_values).abs() <= 4 * d + 1e-12).all()
        x = torch.from_numpy(np.random.default_rng(1).standard_normal((3, ours.shape[1]), dtype=np.float32))
        expected, tol = reference(raw, x)
        assert within(kernels.quant_linear(x, raw, MXFP4, None), expected, tol)
