"""Linears on GGUF's quantized blocks as stored (kernels/cpu/quant.h, models/quantized_linear.py).

Each kernel is checked against a float64 product of the same blocks de-quantized by the `gguf`
package's reference (`gguf.quants.dequantize`). The kernels quantize activations to int8 with a
scale max|x| / 127 per 32 values (per 256 for the K-quants and IQ4_XS, as llama.cpp's Q8_K), so each
activation is off by at most half a step h = max|x of its group| / 254, uniformly for random inputs: an output's error then has standard deviation
sigma = sqrt(sum_k w[n, k]^2 h_k^2 / 3), and the tolerance is 6 sigma, plus 1e-5 of sum_k |w x|
for float32 accumulation, plus 1e-4 (measured errors stay under 3 sigma; the worst case,
sum_k |w| h_k, is about 20x looser and would hide a wrong sub-block scale).
End to end, the embedded default model with quantization auto against none: logits close, greedy
tokens reported, and the engine (prefix cache, chunked prefill, preemption) on the native path.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from model_forward import prefill_logits

from cadenza.kernels.cpu.features import cpu_has_avx2_fma

pytestmark = pytest.mark.skipif(not cpu_has_avx2_fma(), reason="the quantized kernels need x86-64 with AVX2 and FMA")

TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)


# Values an activation scale spans, by weight type (kernels/cpu/quant.cpp, activation_group).
ACTIVATION_GROUP = {Q.Q2_K: 256, Q.Q3_K: 256, Q.Q4_K: 256, Q.Q5_K: 256, Q.Q6_K: 256, Q.IQ4_XS: 256}


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks [rows, bytes per row] with finite, moderate f16 scales."""
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // elems, size), dtype=np.uint8)

    def halves(offset: int, low: float, high: float) -> None:
        values = rng.uniform(low, high, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset : offset + 2] = values.view(np.uint8).reshape(*blocks.shape[:2], 2)

    if qtype in (Q.Q8_0, Q.Q4_0, Q.IQ4_NL):
        halves(0, -0.05, 0.05)
    elif qtype == Q.Q5_0:
        halves(0, -0.025, 0.025)
    elif qtype == Q.IQ4_XS:
        halves(0, 0.0005, 0.002)
    elif qtype in (Q.Q4_1, Q.Q5_1):
        halves(0, 0.001, 0.02)
        halves(2, -0.1, 0.1)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        halves(0, 0.0005, 0.002)
        halves(2, 0.0005, 0.002)
    elif qtype == Q.Q3_K:  # d last
        halves(108, 0.001, 0.005)
    elif qtype == Q.Q2_K:  # d, dmin last
        halves(80, 0.001, 0.005)
        halves(82, 0.001, 0.005)
    else:  # Q6_K: d last
        halves(208, 0.0002, 0.001)
    return blocks.reshape(rows, -1)


def reference(blocks: np.ndarray, qtype: Q, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W^T in float64, the tolerance of each output) for W the de-quantized blocks."""
    w = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float64))
    x64 = x.double()
    group = ACTIVATION_GROUP.get(qtype, 32)
    half_step = x64.abs().reshape(x.shape[0], -1, group).amax(-1).repeat_interleave(group, dim=1) / 254
    sigma = (half_step.square() @ w.square().T / 3).sqrt()
    return x64 @ w.T, 6 * sigma + 1e-5 * (x64.abs() @ w.abs().T) + 1e-4


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_kernel_matches_float64_reference(kernels, qtype, rows):
    rng = np.random.default_rng(int(qtype) * 100 + rows)
    # 37 output rows: not a multiple of the tile (16) or of the rows per pass; 768 inputs: whole
    # 256-value K-quant blocks, not a multiple of 512.
    cols, out_features = 768, 37
    blocks = random_blocks(qtype, out_features, cols, rng)
    x = torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32))
    expected, tol = reference(blocks, qtype, x)
    w = torch.from_numpy(blocks)
    assert kernels.quant_in_features(w, int(qtype)) == cols
    got = kernels.quant_linear(x, w, int(qtype), None)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    err = (got.double() - expected).abs()
    assert (err <= tol).all(), f"max abs error {err.max():.3g}, tolerance there {tol[err == err.max()].min():.3g}"
    bias = torch.from_numpy(rng.standard_normal(out_features, dtype=np.float32))
    residual = torch.from_numpy(rng.standard_normal((rows, out_features), dtype=np.float32))
    summed = kernels.quant_linear_add_(residual.clone(), x, w, int(qtype), bias)
    assert ((summed.double() - (residual.double() + expected + bias.double())).abs() <= tol + 1e-5).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_batched_kernel_matches_float64_reference(kernels, qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols, out_features = 67, 512, 50
    blocks = random_blocks(qtype, out_features, cols, rng)
    x = torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32)) * 3
    expected, tol = reference(blocks, qtype, x)
    got = kernels.quant_linear(x, torch.from_numpy(blocks), int(qtype), None)
    assert ((got.double() - expected).abs() <= tol).all()
    # A column slice of a wider output, as a fused projection of mixed types writes it.
    wide = torch.zeros(rows, out_features + 7)
    kernels.quant_matmul_(wide[:, 3 : 3 + out_features], x, torch.from_numpy(blocks), int(qtype), None, False)
    assert torch.equal(wide[:, 3 : 3 + out_features], got) and not wide[:, :3].any() and not wide[:, -4:].any()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_long_steps_go_in_chunks_of_rows_with_the_same_results(kernels, qtype):
    """A step's activations go through the weight in chunks of 128 KiB of int8 (kernels/cpu/linear.h,
    for_each_tile): 4096 inputs make chunks of 32 rows, so 70 rows are 32 + 32 + 6, file layout and
    packed alike (64 + 6 where the 16-row products decode a group once a chunk: Q5_K, Q6_K, Q3_K);
    every row as from the float64 reference and as computed alone."""
    rng = np.random.default_rng(int(qtype) + 3)
    rows, cols, out_features = 70, 4096, 32
    blocks = random_blocks(qtype, out_features, cols, rng)
    x = torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32))
    expected, tol = reference(blocks, qtype, x)
    weights = [(torch.from_numpy(blocks), int(qtype))]
    if kernels.quant_packs(int(qtype)):
        weights.append((kernels.quant_pack(torch.from_numpy(blocks), int(qtype)), int(qtype) + 256))
    for w, type_id in weights:
        got = kernels.quant_linear(x, w, type_id, None)
        assert ((got.double() - expected).abs() <= tol).all()
        for row in (0, 31, 32, 63, 64, 69):  # either side of each chunk's edge
            assert torch.equal(kernels.quant_linear(x[row : row + 1].clone(), w, type_id, None), got[row : row + 1])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_row_is_the_same_alone_or_in_a_batch(kernels, qtype):
    """Batch invariance, bit for bit: greedy decoding must not depend on what else is in the step."""
    rng = np.random.default_rng(3)
    w = torch.from_numpy(random_blocks(qtype, 40, 512, rng))
    x = torch.from_numpy(rng.standard_normal((13, 512), dtype=np.float32))
    batched = kernels.quant_linear(x, w, int(qtype), None)
    for i in range(13):
        assert torch.equal(batched[i : i + 1], kernels.quant_linear(x[i : i + 1].clone(), w, int(qtype), None))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_dequantize_exactly(kernels, qtype):
    rng = np.random.default_rng(7)
    blocks = random_blocks(qtype, 20, 512, rng)
    ids = torch.tensor([3, 0, 19, 3])
    got = kernels.quant_rows(torch.from_numpy(blocks), int(qtype), ids)
    expected = gguf.quants.dequantize(blocks, qtype)[ids.numpy()]
    assert torch.equal(got, torch.from_numpy(expected.astype(np.float32)))
    whole = kernels.quant_dequantize(torch.from_numpy(blocks), int(qtype))
    reference_rows = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    # Vectorized: q * scale + offset in one fma, where the reference rounds twice.
    assert torch.allclose(whole, reference_rows, rtol=1e-6, atol=1e-6)
    # Straight to bfloat16 (the GEMM scratch on CPUs with native bf16): rounded as PyTorch rounds.
    as_bf16 = kernels.quant_dequantize_(torch.empty(whole.shape, dtype=torch.bfloat16), torch.from_numpy(blocks), int(qtype))
    assert torch.equal(as_bf16, whole.bfloat16())


PACKABLE = TYPES


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_packed_layout_matches_the_reference_and_the_file_layout(kernels, qtype):
    """kernels/cpu/quant_packed.h: rows re-laid a group at a time (16 for AVX-512 VNNI, 8 for AVX2 and
    AVX-VNNI). Products within the float64 tolerance, every row the same alone or in a batch of any
    size, rows and whole weights de-quantized exactly as from the file's layout."""
    if not kernels.quant_packs(int(qtype)):
        pytest.skip(f"this build ({kernels.packed_path()}) has no packed products for {qtype.name}")
    group = kernels.pack_rows()
    assert group == (16 if kernels.packed_path().endswith("packed16") else 8)
    rng = np.random.default_rng(int(qtype) + 11)
    cols, out_features = 768, 48  # 3 groups of 16, 6 of 8
    blocks = random_blocks(qtype, out_features, cols, rng)
    w = torch.from_numpy(blocks)
    packed, packed_type = kernels.quant_pack(w, int(qtype)), int(qtype) + 256
    assert packed.shape == w.shape and kernels.quant_in_features(packed, packed_type) == cols
    assert not torch.equal(packed[:group], w[:group])  # re-laid, not copied
    x = torch.from_numpy(rng.standard_normal((17, cols), dtype=np.float32))
    expected, tol = reference(blocks, qtype, x)
    got = kernels.quant_linear(x, packed, packed_type, None)
    assert ((got.double() - expected).abs() <= tol).all()
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16):  # a row's sum does not depend on how many rows share the call (passes of 4 or 8)
        assert torch.equal(kernels.quant_linear(x[:rows].clone(), packed, packed_type, None), got[:rows])
    bias = torch.from_numpy(rng.standard_normal(out_features, dtype=np.float32))
    residual = torch.from_numpy(rng.standard_normal((17, out_features), dtype=np.float32))
    summed = kernels.quant_linear_add_(residual.clone(), x, packed, packed_type, bias)
    assert torch.equal(summed, residual + kernels.quant_linear(x, packed, packed_type, bias))
    wide = torch.zeros(17, out_features + 5)  # a column slice of a wider output (a fused projection's part)
    kernels.quant_matmul_(wide[:, 2 : 2 + out_features], x, packed, packed_type, None, False)
    assert torch.equal(wide[:, 2 : 2 + out_features], got) and not wide[:, :2].any() and not wide[:, -3:].any()
    ids = torch.tensor([0, 17, 47, 16, 3, 9])
    assert torch.equal(kernels.quant_rows(packed, packed_type, ids), kernels.quant_rows(w, int(qtype), ids))
    assert torch.equal(kernels.quant_dequantize(packed, packed_type), kernels.quant_dequantize(w, int(qtype)))
    for dtype in (torch.float32, torch.bfloat16):  # a prefill GEMM's scratch (Q6_K: straight from the groups, zmm builds)
        from_groups, from_file = torch.empty(out_features, cols, dtype=dtype), torch.empty(out_features, cols, dtype=dtype)
        kernels.quant_dequantize_(from_groups, packed, packed_type)
        kernels.quant_dequantize_(from_file, w, int(qtype))
        assert torch.equal(from_groups, from_file)
    with pytest.raises(RuntimeError, match=f"multiple of {group}"):
        kernels.quant_pack(w[: group + 4].contiguous(), int(qtype))


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_packed_products_hold_at_the_extremes_of_their_integer_sums(kernels, qtype):
    """Every weight byte at its largest (nibbles 15, Q8_0's -128 and 127) against activations at
    +-127 (each block's maximum): the products whose int16 partial sums have the least headroom
    (AVX2's vpmaddubsw pairs) must not saturate."""
    if not kernels.quant_packs(int(qtype)):
        pytest.skip(f"this build ({kernels.packed_path()}) has no packed products for {qtype.name}")
    rng = np.random.default_rng(5)
    cols, out_features = 512, 2 * kernels.pack_rows()
    blocks = random_blocks(qtype, out_features, cols, rng)
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    view = blocks.reshape(out_features, cols // elems, size)
    values = {Q.Q8_0: slice(2, 34), Q.Q4_0: slice(2, 18), Q.Q4_1: slice(4, 20), Q.Q5_0: slice(2, 22), Q.Q5_1: slice(4, 24),
              Q.Q2_K: slice(0, 80), Q.Q3_K: slice(0, 96), Q.Q4_K: slice(16, 144), Q.Q5_K: slice(16, 176), Q.Q6_K: slice(0, 192), Q.IQ4_NL: slice(2, 18),
              Q.IQ4_XS: slice(8, 136)}[qtype]
    view[: out_features // 2, :, values] = 0xFF  # nibbles 15 (Q8_0: -1, Q5_x: 31, Q6_K: 63, Q3_K: 7; Q2_K: 3, scales and mins 15)
    if qtype == Q.Q6_K:  # scales at their extremes too
        view[:, :, 192:208] = np.where(np.arange(out_features) % 2, 0x80, 0x7F).astype(np.uint8)[:, None, None]
    if qtype == Q.Q3_K:  # scales -32 and 31
        view[:, :, 96:108] = np.where(np.arange(out_features) % 2, 0x00, 0xFF).astype(np.uint8)[:, None, None]
    if qtype == Q.Q8_0:  # a group of -128s and one of 127s
        view[out_features // 2 :, :, values] = np.where(np.arange(out_features // 2) < out_features // 4, 0x80, 0x7F)[:, None, None]
    x = torch.from_numpy(np.where(rng.random((3, cols)) < 0.5, -1.0, 1.0).astype(np.float32))
    x[1] = 1.0  # every activation +127 after rounding: sums of one sign only
    expected, tol = reference(blocks, qtype, x)
    packed = kernels.quant_pack(torch.from_numpy(blocks), int(qtype))
    got = kernels.quant_linear(x, packed, int(qtype) + 256, None)
    assert ((got.double() - expected).abs() <= tol).all()


@pytest.mark.parametrize("rows", [3, 70])  # the kernel; the de-quantized GEMM (GEMM_MIN_ROWS, any CPU)
def test_quantized_linear_of_mixed_parts(kernels, rows):
    """A fused projection whose parts differ in type (q/k Q4_K, v Q6_K, as Q4_K_M files have them)."""
    from cadenza.models.quantized_linear import GEMM_MIN_ROWS, QuantizedLinear, QuantizedTensor

    assert (rows >= GEMM_MIN_ROWS) == (rows == 70)
    rng = np.random.default_rng(rows)
    parts = [(Q.Q4_K, 24), (Q.Q4_K, 8), (Q.Q6_K, 12)]  # 12 rows: Q6_K stays in the file's layout in every build
    blocks = [random_blocks(qtype, n, 256, rng) for qtype, n in parts]
    linear = QuantizedLinear(256, 44, bias=True)
    first = 0
    for (qtype, n), b in zip(parts, blocks):
        linear.load_rows(first, QuantizedTensor(torch.from_numpy(b), int(qtype), 256))
        first += n
    linear.finish_loading()
    assert [q for _, q in linear.parts] == [int(Q.Q4_K), int(Q.Q6_K)]  # same-type neighbours joined
    with torch.no_grad():
        linear.bias.copy_(torch.randn(44))
    linear.use_cpu_kernels(kernels)
    assert [bool(q & 256) for _, q in linear.parts] == [kernels.quant_packs(int(Q.Q4_K)), False]
    x = torch.from_numpy(rng.standard_normal((rows, 256), dtype=np.float32))
    assert linear._uses_gemm(x) == (rows == 70)  # a part in the file's layout: the GEMM from GEMM_MIN_ROWS
    expected = torch.cat([reference(b, q, x)[0] for b, (q, _) in zip(blocks, parts)], dim=1) + linear.bias.double()
    tol = torch.cat([reference(b, q, x)[1] for b, (q, _) in zip(blocks, parts)], dim=1)
    assert ((linear(x).double() - expected).abs() <= tol).all()
    residual = torch.randn(rows, 44)
    summed = linear.linear_add_(residual.clone(), x)
    assert ((summed.double() - residual.double() - expected).abs() <= tol + 1e-5).all()


def test_kernel_rejects_wrong_inputs(kernels):
    w = torch.zeros(4, 20 * 3, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="features"):
        kernels.quant_linear(torch.zeros(1, 64), w, int(Q.Q4_1), None)
    with pytest.raises(RuntimeError, match="no kernel"):
        kernels.quant_linear(torch.zeros(1, 96), w, int(Q.IQ2_XXS), None)
    with pytest.raises(RuntimeError, match="whole number"):
        kernels.quant_linear(torch.zeros(1, 96), torch.zeros(4, 61, dtype=torch.uint8), int(Q.Q4_1), None)
    with pytest.raises(RuntimeError, match="packs no weights of type 16"):  # IQ2_XXS: no packed layout
        kernels.quant_linear(torch.zeros(1, 256), torch.zeros(16, 66, dtype=torch.uint8), int(Q.IQ2_XXS) + 256, None)
    with pytest.raises(RuntimeError, match="multiple of"):
        kernels.quant_linear(torch.zeros(1, 32), torch.zeros(4, 20, dtype=torch.uint8), int(Q.Q4_1) + 256, None)


# --- the default model end to end -----------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:", "Once upon a time"]


@pytest.fixture(scope="module")
def default_models(kernels):
    """The embedded default model run natively (bf16 dtype, quantization auto) and de-quantized to
    float32 (the exact weights), loaded once."""
    from cadenza.models.loading import load_model

    native = load_model(None, dtype=torch.bfloat16, cpu_kernels="on", quantization="auto")
    exact = load_model(None, dtype=torch.float32, cpu_kernels="on", quantization="none")
    return native, exact


def last_logits(loaded, token_ids: list[int]) -> torch.Tensor:
    """Logits after a one-sequence prefill of `token_ids` (eager attention, a fresh cache)."""
    return prefill_logits(loaded, token_ids)[-1]


def test_default_model_runs_its_blocks_natively(default_models):
    from cadenza.models.quantized_linear import QuantizedEmbedding, QuantizedLinear

    native, exact = default_models
    model = native.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and isinstance(model.lm_head, QuantizedLinear)
    assert model.lm_head.blocks0 is model.embed_tokens.blocks  # the tied head reads the same blocks
    # Packed for the kernels, all in one (huge-page) buffer: models/weight_arena.py.
    storages = {b.untyped_storage().data_ptr() for name, b in model.named_buffers() if "blocks" in name.rpartition(".")[2]}
    assert len(storages) == 1
    assert all(isinstance(m, QuantizedLinear) for m in (model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.down_proj))
    assert model.layers[0].fused is not None and native.compute_dtype == torch.float32
    # No de-quantized copy: every linear weight is the file's bytes (98 MB file, F32 norms aside).
    # (named_buffers lists the tied head's blocks once.)
    weight_bytes = sum(b.numel() for name, b in model.named_buffers() if "blocks" in name.rpartition(".")[2])
    assert 90e6 < weight_bytes < 98.4e6
    assert not any(p.numel() > 1e5 for p in model.parameters())


def test_default_model_logits_close_to_dequantized(default_models):
    native, exact = default_models
    tokenizer = native.tokenizer
    report = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        got, expected = last_logits(native, ids), last_logits(exact, ids)
        diff = (got - expected).abs().max().item()
        report.append((prompt, diff, expected.abs().max().item(), int(got.argmax()), int(expected.argmax())))
    print("\n".join(f"{p!r}: max abs logit diff {d:.3f} (logits up to {s:.1f}), argmax {a} vs {b}" for p, d, s, a, b in report))
    # int8 activations (as llama.cpp's): logits move by a few hundredths of their range, the top
    # token stays. The largest of 49k differences is the noise's tail: 2-8% of the range over ten
    # prompts, file layout or packed alike (perplexity, test_quantized_quality, is the tight check).
    assert all(d < 0.1 * s for _, d, s, _, _ in report)
    assert all(a == b for *_, a, b in report)


def test_default_model_greedy_tokens_reported(default_models):
    """Greedy continuations (5 tokens, full recompute each step) of both paths, printed side by side."""
    native, exact = default_models
    agree = []
    for prompt in PROMPTS[:2]:
        runs = []
        for loaded in (native, exact):
            ids = native.tokenizer.encode(prompt)
            for _ in range(5):
                ids.append(int(last_logits(loaded, ids).argmax()))
            runs.append(ids[-5:])
        same = next((i for i, (a, b) in enumerate(zip(*runs)) if a != b), 5)
        agree.append(same)
        print(f"{prompt!r}: auto {native.tokenizer.decode(runs[0])!r} | none {native.tokenizer.decode(runs[1])!r} ({same}/5 agree)")
    assert min(agree) >= 1


def test_engine_on_native_path_with_small_cache(kernels):
    """Prefix cache, chunked prefill and preemption over the quantized model. Steps stay under the
    GEMM's row threshold (chunks of 16, at most 19 rows a step), where every row is computed alone:
    the packed int8 products and the paged attention are batch invariant, so each request's tokens
    must equal its tokens run alone, however it was chunked, batched, preempted and recomputed.
    Every request must finish, reuse the cached system prompt, and free its blocks."""
    from cadenza import LLM, SamplingParams

    system = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [system + q for q in ("What is 2+2?", "Name a fruit.", "Say hi.", "Count to three.")]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    small_steps = {"chunk_size": 16, "max_num_batched_tokens": 19}
    with LLM(block_size=8, num_blocks=256, quantization="auto", **small_steps) as roomy:
        assert roomy.runtime.loaded.model.layers[0].fused is not None
        alone = [roomy.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    with LLM(block_size=8, num_blocks=16, quantization="auto", **small_steps) as tight:
        outs = tight.generate(prompts, params)
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert [o.outputs[0].token_ids for o in outs] == alone
        assert tight.engine.metrics.num_preemptions > 0
        assert any(o.num_cached_tokens > 0 for o in outs)  # the shared system prompt was reused
        again = tight.generate(prompts[:1], params)[0]
        assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == alone[0]
        core = tight.engine.cache_core
        assert core.num_available == core.num_blocks


def test_bench_roofline_counts_the_blocks_a_step_reads(default_models):
    from cadenza.bench.offline.ceilings import ModelCost

    native, exact = default_models
    quantized = ModelCost.from_arch(native.arch, torch.bfloat16, model=native.model)
    assert 90e6 < quantized.weight_bytes < 98.4e6  # the file's blocks (tied head once), not bf16's 269 MB
    plain = ModelCost.from_arch(exact.arch, torch.bfloat16, model=exact.model)
    assert plain.weight_bytes == 2 * (plain.body_params + plain.head_params)


def test_load_says_which_layout_each_block_type_runs_in(default_models, kernels):
    from cadenza.models.quantized_linear import block_layouts

    native, _ = default_models
    layouts = {e["type"]: e for e in block_layouts(native.model, native.model.kernels)}
    assert set(layouts) == {"Q4_1", "Q8_0"}  # the default model's linears and its tied embedding
    assert layouts["Q4_1"]["tensors"] == 30 * 4 and layouts["Q8_0"]["tensors"] == 2  # head + embedding
    for name, entry in layouts.items():
        packed = kernels.quant_packs(int(getattr(Q, name)))
        assert entry["packed"] == packed
        assert entry["path"] == kernels.packed_path() if packed else "no packed products" in entry["reason"]
