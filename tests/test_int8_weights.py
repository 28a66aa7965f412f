"""`model.quantization: int8`: a float checkpoint's linears as Q8_0 blocks, quantized on load."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from model_forward import prefill_logits

from cadenza.models.errors import ModelLoadError
from cadenza.models.int8_weights import plan_int8_weights, quantize_q8_0
from cadenza.models.loading import load_model
from cadenza.models.quantized_linear import QuantizedEmbedding, QuantizedLinear


def test_q8_0_blocks_decode_as_gguf_reads_them():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((7, 96)).astype(np.float32) * rng.uniform(0.01, 3, size=(7, 1)).astype(np.float32)
    weight[2, :32] = 0  # an all-zero group: scale 0, values 0
    q = quantize_q8_0(torch.from_numpy(weight))
    assert q.qtype == int(gguf.GGMLQuantizationType.Q8_0) and q.shape == (7, 96) and q.blocks.shape == (7, 3 * 34)
    decoded = gguf.quants.dequantize(q.blocks.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(7, 96)
    groups = np.abs(weight.reshape(7, 3, 32)).max(axis=-1, keepdims=True)
    # Within half a step of each group's grid (plus the float16 rounding of the scale).
    error = np.abs(decoded - weight).reshape(7, 3, 32)
    assert (error <= groups / 127 * 0.5 * (1 + 2e-3) + 1e-7).all()
    assert (decoded[2, :32] == 0).all()


def test_width_not_a_multiple_of_32_keeps_the_fused_group_float():
    shapes = {
        "model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.self_attn.k_proj.weight": (32, 64),
        "model.layers.0.self_attn.v_proj.weight": (32, 64), "model.layers.0.self_attn.o_proj.weight": (64, 48),
        "model.layers.0.mlp.gate_proj.weight": (40, 64), "model.layers.0.mlp.up_proj.weight": (40, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 40), "model.layers.0.input_layernorm.weight": (64,),
        "model.embed_tokens.weight": (320, 64),
    }
    kept = plan_int8_weights(shapes)
    assert kept == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                    "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                    "model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"}


def weight_rounding_ratio(directory) -> float:
    """How much coarser Q8_0 blocks round this checkpoint's quantized weights than bfloat16 does:
    the ratio of the two roundings' error norms over every weight the int8 load quantizes, in
    float64 (a property of the weights alone, the same on every CPU)."""
    from safetensors.torch import load_file

    tensors = {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}
    q8 = bf16 = 0.0
    for name in plan_int8_weights({k: tuple(v.shape) for k, v in tensors.items()}):
        w = tensors[name].double()
        blocks = quantize_q8_0(w).blocks.numpy()
        decoded = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).astype(np.float64))
        q8 += (decoded.view(w.shape) - w).pow(2).sum().item()
        bf16 += (w.bfloat16().double() - w).pow(2).sum().item()
    return (q8 / bf16) ** 0.5


@pytest.mark.parametrize("arch", ["llama3", "smollm_tied", "qwen3", "llama2_bias"])
def test_int8_model_close_to_float(kernels, tiny_model_dir, arch):
    directory = tiny_model_dir(arch)
    exact = load_model(directory, dtype=torch.float32)
    int8 = load_model(directory, dtype=torch.bfloat16, quantization="int8", cpu_kernels="auto")
    linears = [m for m in int8.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 2 * 4 + 1  # per layer: qkv, o, gate_up, down; the LM head (tied or not)
    assert isinstance(int8.model.embed_tokens, QuantizedEmbedding)
    assert not any(isinstance(p, torch.Tensor) and p.dim() == 2 for p in int8.model.parameters())  # no float copy
    # The yardstick: bf16-rounded weights in exact (float32) arithmetic. Its error is what rounding
    # the weights to bfloat16 costs, the same on every CPU; a bf16 model computing in bf16 would
    # add its activations' rounding only where the CPU has native bf16 (cpu_fp32_matmul: auto).
    bf16_weights = load_model(directory, dtype=torch.bfloat16, cpu_fp32_matmul="on")
    ids = [5, 17, 101, 33, 250, 7, 64, 12, 199, 3, 80, 41] * 2
    want = prefill_logits(exact, ids)

    def error(loaded) -> float:
        return ((prefill_logits(loaded, ids) - want).norm() / want.norm()).item()

    # int8 weights per 32 values and int8 (or, in a GEMM, bf16) activations: measured 2.5-5.2% of
    # the logits' norm on these random models, 1.9-2.6x under the bound below, as AVX2 and as AVX-512.
    assert error(int8) < 0.08
    # Small roundings reach the logits about linearly: Q8_0 rounds these weights `ratio` times as
    # coarsely as bf16 (3.2x here), and the activations' rounding, of the same size at most, adds up to
    # sqrt(2) more. Twice that leaves room for the linearisation, not for a wrong kernel.
    ratio = weight_rounding_ratio(directory)
    assert 2.5 < ratio < 5  # a group's absmax / 254 against 2^-9 of each value
    assert error(int8) < 2 * 2**0.5 * ratio * error(bf16_weights)


def test_int8_on_float32_model_needs_kernels_not_16_bit(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="int8 cannot run here: model.cpu_kernels is off"):
        load_model(tiny_model_dir("llama3"), quantization="int8", cpu_kernels="off")


def test_engine_runs_an_int8_deployment(kernels, tiny_model_dir):
    from cadenza.llm import LLM
    from cadenza.sampling_params import SamplingParams

    llm = LLM(str(tiny_model_dir("llama3")), quantization="int8", dtype="bfloat16")
    try:
        outs = llm.generate([[5, 17, 101], [9, 9, 9, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
        alone = llm.generate([[9, 9, 9, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert alone[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    finally:
        llm.close()
