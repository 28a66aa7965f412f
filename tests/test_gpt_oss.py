"""gpt-oss as OpenAI ships it: experts in MXFP4 (`*_blocks` and `*_scales`) beside bfloat16 weights.

Such a checkpoint loads with its experts as MXFP4 blocks on the kernels (or, in float32, de-quantized
exactly) and computes what its de-quantized weights compute in transformers; llama.cpp's converter
keeps the experts MXFP4, byte for byte what cadenza re-lays them as, and its file computes the same
in cadenza and in llama-server. (The float checkpoint's parity, sinks, windows and YaRN included,
is in test_model_parity.py; its routing and experts kernel in test_moe.py.)
"""

from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from cadenza.models.loading import load_model
from cadenza.models.mxfp4 import QTYPE, dequantize_mxfp4, mxfp4_from_hf, quantize_mxfp4_hf
from cadenza.models.quantized_linear import PACKED_FLAG, QuantizedLinear
from tests.model_forward import prefill_logits
from tests.tiny_models import build_tiny_model, build_tokenizer

PROMPT = [5, 17, 101, 33, 250, 7, 64, 12, 199, 3, 80, 41, 9, 290, 2, 77]
_STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(MXFP4 checkpoint, float checkpoint of exactly its values): a tiny gpt-oss whose expert
    stacks are quantized to MXFP4 as a Hugging Face checkpoint stores them ([experts, out, in]
    blocks), and the same model with those stacks de-quantized back into the float layout."""
    root = tmp_path_factory.mktemp("gpt-oss")
    # The converter trims the embedding to the tokenizer's size; llama.cpp's graph clamps at 7.
    source = build_tiny_model(root / "source", "gpt_oss", vocab_size=len(build_tokenizer()), swiglu_limit=7.0,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                                               "original_max_position_embeddings": 64})  # fmt: skip
    mxfp4_dir, float_dir = root / "mxfp4", root / "float"
    shutil.copytree(source, mxfp4_dir)
    shutil.copytree(source, float_dir)
    quantized, exact = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if not name.endswith(_STACKS):
            quantized[name] = exact[name] = tensor
            continue
        out_in = tensor.transpose(1, 2).contiguous()  # the float layout is [experts, in, out]
        blocks, scales = quantize_mxfp4_hf(out_in)
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        values = dequantize_mxfp4(mxfp4_from_hf(blocks, scales)).reshape(out_in.shape)
        exact[name] = values.transpose(1, 2).contiguous()
    save_file(quantized, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(exact, float_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mxfp4_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (mxfp4_dir / "config.json").write_text(json.dumps(config))
    return mxfp4_dir, float_dir


def reference_logits(directory) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


def test_an_mxfp4_checkpoint_in_float32_computes_its_exact_values(checkpoints):
    mxfp4_dir, float_dir = checkpoints
    loaded = load_model(mxfp4_dir, dtype=torch.float32)
    assert not any(isinstance(m, QuantizedLinear) for m in loaded.model.modules())  # float32: de-quantized
    torch.testing.assert_close(prefill_logits(loaded, PROMPT), reference_logits(float_dir), rtol=1e-4, atol=1e-4)


def test_an_mxfp4_checkpoints_experts_run_as_mxfp4_on_the_kernels(kernels, checkpoints):
    from tests.test_moe import mixtures, routed_logits

    mxfp4_dir, float_dir = checkpoints
    native = load_model(mxfp4_dir, dtype=torch.bfloat16, quantization="auto", cpu_kernels="auto")
    experts = [e for moe in mixtures(native) for e in moe.experts]
    assert experts and all(q & ~PACKED_FLAG == QTYPE for e in experts for m in (e.gate_up_proj, e.down_proj)
                           for _, q in m.parts)
    assert all(moe.fused is not None for moe in mixtures(native))  # decode steps: one kernel call a layer
    exact = load_model(float_dir, dtype=torch.float32)
    (want, want_routes), (got, got_routes) = routed_logits(exact, PROMPT), routed_logits(native, PROMPT)
    same = (want_routes == got_routes).all(dim=(0, 2))
    assert same.sum() >= 0.75 * len(PROMPT)  # a token rounding sends to other experts computes another function
    error = (got - want)[same].norm() / want[same].norm()
    assert error < 0.05  # the activations' int8 rounding only: the weights are the file's exact values


def test_llamacpps_converter_keeps_the_experts_mxfp4_as_cadenza_lays_them(checkpoints, tmp_path):
    from cadenza.bench.peers.convert import convert_hf_to_gguf
    from tests.test_families import assert_llamacpp_agrees

    mxfp4_dir, float_dir = checkpoints
    path = convert_hf_to_gguf(mxfp4_dir, tmp_path / "gpt-oss-mxfp4.gguf", "f32", pre_tokenizer="qwen2")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    stored = load_file(mxfp4_dir / "model.safetensors")
    blocks, scales = stored["model.layers.0.mlp.experts.gate_up_proj_blocks"], stored["model.layers.0.mlp.experts.gate_up_proj_scales"]
    ours = mxfp4_from_hf(blocks, scales)  # [experts, 2I, bytes]: gate rows even, up rows odd
    gate = tensors["blk.0.ffn_gate_exps.weight"]
    assert gate.tensor_type == gguf.GGMLQuantizationType.MXFP4
    assert torch.equal(torch.from_numpy(gate.data.copy()).reshape(ours[:, 0::2].shape), ours[:, 0::2])
    loaded = load_model(path, dtype=torch.float32)
    torch.testing.assert_close(prefill_logits(loaded, PROMPT), reference_logits(float_dir), rtol=1e-4, atol=1e-4)
    # llama.cpp multiplies MXFP4 weights by activations rounded to Q8_0 blocks: the greedy token
    # agrees, its top log-probabilities to that rounding (measured up to 0.055 here; a nibble or
    # scale read wrongly moves them by whole units).
    assert_llamacpp_agrees(path, PROMPT, torch.log_softmax(prefill_logits(loaded, PROMPT)[-1], -1), 256, tolerance=0.1)
