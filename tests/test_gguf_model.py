"""GGUF model loading against transformers loading the same file (fp32).

Both de-quantize with `gguf.quants.dequantize` and undo llama.cpp's q/k row interleaving, so the
weights must be bit-identical, the logits agree to float rounding and greedy tokens agree. Two files:
- the embedded default model (SmolLM2-135M-Instruct: Q4_1 and Q8_0, tied embeddings);
- a tiny random Llama written here with `gguf.GGUFWriter`, its tensors spread over every quant
  type we promise (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
  IQ4_NL, IQ4_XS), with attention biases, q/k weights and biases permuted as llama.cpp's converter does.
  Its tensors made from known values are also checked against those values, which needs no
  transformers; and at bfloat16 every quantized type runs on the CPU kernels, packed, its logits
  near the exact ones.
Plus the errors a bad file must give: unsupported quant type or architecture, a corrupt or
truncated file, a missing path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from tiny_models import SPECIAL_TOKENS, build_tokenizer

from cadenza import LLM, SamplingParams
from cadenza.models.default_model import default_model_path
from cadenza.models.errors import ModelLoadError, UnsupportedModelError
from cadenza.models.gguf_loader import iter_gguf_weights, open_gguf, read_gguf_config
from cadenza.models.loading import load_model
from cadenza.runner.model_runner import ScheduledChunk

BLOCK = 16
# HF projection -> the cadenza parameter it is fused into (q, k, v rows in that order; gate, up).
_FUSED = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
}


def load_reference(path: Path, **config):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **config
    ).eval()
    model.generation_config.eos_token_id = None  # run the full length, as ignore_eos does
    model.generation_config.pad_token_id = 0
    return model


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def make_llm(path: Path | None) -> LLM:
    # No prefix caching: `prefill_logits` writes KV blocks behind the (idle) engine's back.
    return LLM(path, dtype="float32", num_blocks=64, block_size=BLOCK, enable_prefix_caching=False)


def prefill_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """cadenza's logits at the last position of each prompt, all prompts in one runner step."""
    chunks, start = [], 0
    for i, prompt in enumerate(prompts):
        blocks = -(-len(prompt) // BLOCK)
        chunks.append(ScheduledChunk(str(i), prompt, 0, list(range(start, start + blocks))))
        start += blocks
    return llm.runtime.runner.execute(chunks, return_logits=True).logits


def reference_last_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])


def assert_same_weights(llm: LLM, reference) -> None:
    """cadenza's parameters equal transformers' exactly (q/k/v and gate/up fused in cadenza)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for name, tensor in reference.state_dict().items():
        name = name.removeprefix("model.")
        for part, fused in _FUSED.items():
            name = name.replace(f".{part}.", f".{fused}.")
        parts.setdefault(name, []).append(tensor)  # registration order: q, k, v and gate, up
    expected = {name: torch.cat(ts) for name, ts in parts.items()}
    ours = dict(llm.runtime.loaded.model.named_parameters(remove_duplicate=False))
    assert sorted(ours) == sorted(expected)
    for name, param in ours.items():
        assert param.dtype == torch.float32
        assert torch.equal(param, expected[name]), name


# ---------------------------------------------------------------------------------------------
# The embedded default model.

DEFAULT_PROMPTS = [
    "The three primary colors are",
    [{"role": "user", "content": "Give me two tips for writing clear emails."}],
    "def fibonacci(n):\n    ",
    "La capitale de la France est",
]
DEFAULT_TOKENS = 32


@pytest.fixture(scope="module")
def default_llm():
    with make_llm(None) as llm:
        yield llm


@pytest.fixture(scope="module")
def default_reference():
    return load_reference(default_model_path())


@pytest.fixture(scope="module")
def default_outputs(default_llm):
    # One batched call: prompts of different lengths prefill together, then decode together.
    return default_llm.generate(
        DEFAULT_PROMPTS, SamplingParams(temperature=0, max_tokens=DEFAULT_TOKENS, ignore_eos=True)
    )


def test_default_model_weights_identical(default_llm, default_reference):
    assert default_llm.runtime.loaded.arch.tie_word_embeddings
    assert_same_weights(default_llm, default_reference)


def test_default_model_prefill_logits_match(default_llm, default_reference, default_outputs):
    prompts = [out.prompt_token_ids for out in default_outputs]
    ours = prefill_logits(default_llm, prompts)
    expected = reference_last_logits(default_reference, prompts)
    diff = (ours - expected).abs().max().item()
    # Measured 4e-5 with logits up to ~31; q/k left interleaved moves them by ~15.
    assert diff < 1e-3, f"max abs logit diff {diff:.2e}"


def test_default_model_greedy_matches_transformers(default_reference, default_outputs):
    assert len({len(out.prompt_token_ids) for out in default_outputs}) > 1  # mixed lengths, one batch
    for prompt, request in zip(DEFAULT_PROMPTS, default_outputs):
        out = request.outputs[0]
        assert out.finish_reason == "length"
        assert out.token_ids == reference_greedy(default_reference, request.prompt_token_ids, DEFAULT_TOKENS), prompt
        assert out.text


# ---------------------------------------------------------------------------------------------
# A tiny Llama written to GGUF with every quant type we promise.

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 320
# Each matrix its own type, so that together they cover every required one; q and k (the
# permuted ones) go through a block quant, a super-block quant and a float type. Attention
# biases, which llama.cpp permutes for q and k too, stay F32 as llama.cpp keeps 1-D tensors.
QUANT_TYPES = {
    "token_embd.weight": Q.Q8_0,
    "output_norm.weight": Q.F32,
    "output.weight": Q.Q6_K,
    "blk.0.attn_norm.weight": Q.F32,
    "blk.0.attn_q.weight": Q.Q4_K,
    "blk.0.attn_k.weight": Q.Q4_0,
    "blk.0.attn_v.weight": Q.Q4_1,
    "blk.0.attn_output.weight": Q.BF16,
    "blk.0.ffn_norm.weight": Q.F32,
    "blk.0.ffn_gate.weight": Q.Q5_0,
    "blk.0.ffn_up.weight": Q.Q2_K,
    "blk.0.ffn_down.weight": Q.Q3_K,
    "blk.1.attn_norm.weight": Q.F32,
    "blk.1.attn_q.weight": Q.BF16,
    "blk.1.attn_k.weight": Q.Q4_K,
    "blk.1.attn_v.weight": Q.F16,
    "blk.1.attn_output.weight": Q.IQ4_NL,
    "blk.1.ffn_norm.weight": Q.F32,
    "blk.1.ffn_gate.weight": Q.Q5_1,
    "blk.1.ffn_up.weight": Q.IQ4_XS,
    "blk.1.ffn_down.weight": Q.Q5_K,
    **{f"blk.{i}.attn_{part}.bias": Q.F32 for i in range(LAYERS) for part in ("q", "k", "v", "output")},
}
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, *part, kind = hf_name.split(".")
    return f"blk.{layer}.{_GGUF_NAMES['.'.join(part)]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave each head's rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Byte offset and value (times the wanted standard deviation) of each fp16 scale in a block of a type
# gguf cannot quantize; every other byte is random quant bits. The multipliers make the values come
# out roughly zero-mean with that standard deviation.
_RAW_SCALES = {
    Q.Q2_K: ((80, 1 / 14), (82, 1.5 / 14)),  # 16 bytes of 4-bit scales and mins, 64 of 2-bit values; d, dmin last
    Q.Q3_K: ((108, 1 / 43),),  # 32 bytes of third bits, 64 of 2-bit values, 12 of 6-bit signed scales; d last
    Q.Q4_K: ((0, 1 / 258), (2, 7.5 / 258)),  # d, dmin; 12 bytes of 6-bit scales/mins; 128 of nibbles
    Q.Q5_K: ((0, 1 / 516), (2, 15.5 / 516)),  # d, dmin; Q4_K's 12 bytes of scales/mins; 32 of fifth bits; 128 of nibbles
    Q.Q6_K: ((208, 1 / 1370),),  # 128 bytes low nibbles, 64 high bits, 16 int8 scales; d last
    Q.IQ4_NL: ((0, 1 / 70),),  # d; 16 bytes of indices into a fixed 4-bit table
    Q.IQ4_XS: ((0, 1 / 1200),),  # d; 6-bit scales (2 bytes of high bits, 4 of low); 128 bytes of indices
    Q.IQ2_XXS: ((0, 1 / 100),),  # d; the rest indices into grids (a type no kernel reads)
}


def random_raw_blocks(shape: tuple[int, int], qtype: Q, std: float, rng: np.random.Generator) -> np.ndarray:
    """Valid `qtype` blocks for a `shape` tensor: random quant bits, small finite fp16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // block_size, type_size), dtype=np.uint8)
    for offset, factor in _RAW_SCALES[qtype]:
        blocks[..., offset : offset + 2] = np.frombuffer(np.float16(std * factor).tobytes(), np.uint8)
    return blocks.reshape(shape[0], -1)


def encode_tensor(array: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, Q | None]:
    """(the array to write, its raw_dtype); types gguf cannot quantize get random raw blocks."""
    if qtype in (Q.F32, Q.F16):
        return gguf.quants.quantize(array, qtype), None
    if qtype in _RAW_SCALES:
        return random_raw_blocks(array.shape, qtype, float(array.std()), rng), qtype
    return gguf.quants.quantize(array, qtype), qtype


def tokenizer_metadata(writer: gguf.GGUFWriter) -> None:
    tok = build_tokenizer()
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    types = [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    # Pad to the model's vocabulary as convert_hf_to_gguf.py does.
    pad = [f"[PAD{i}]" for i in range(len(tokens), VOCAB)]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens + pad)
    writer.add_token_types(types + [gguf.TokenType.UNUSED] * len(pad))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tok.convert_tokens_to_ids("<|endoftext|>"))
    writer.add_eos_token_id(tok.convert_tokens_to_ids("<|im_end|>"))
    writer.add_add_bos_token(False)


def write_tiny_llama_gguf(
    path: Path, quant_types: dict[str, Q] = QUANT_TYPES, architecture: str = "llama", seed: int = 0
) -> dict[str, np.ndarray]:
    """Write the tiny model; return, by HF name, the values each quantized tensor was made from."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        initializer_range=0.08, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        attention_bias=True,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name("tiny-llama")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    tokenizer_metadata(writer)
    sources = {}
    for hf_name, tensor in model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        # All-ones norms and all-zero biases (transformers' init) would hide a mix-up.
        if hf_name.endswith("norm.weight"):
            array = (1 + 0.2 * rng.standard_normal(array.shape)).astype(np.float32)
        elif hf_name.endswith(".bias"):
            array = (0.5 * rng.standard_normal(array.shape)).astype(np.float32)
        name = gguf_name(hf_name)
        if quant_types[name] not in _RAW_SCALES:
            sources[hf_name] = array
        if ".attn_q." in name:
            array = llama_cpp_permute(array, HEADS)
        elif ".attn_k." in name:
            array = llama_cpp_permute(array, KV_HEADS)
        data, raw_dtype = encode_tensor(array, quant_types[name], rng)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sources


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.gguf"
    return path, write_tiny_llama_gguf(path)


@pytest.fixture(scope="module")
def tiny_llm(tiny_gguf):
    with make_llm(tiny_gguf[0]) as llm:
        yield llm


@pytest.fixture(scope="module")
def tiny_reference(tiny_gguf):
    # transformers reads no attention_bias from GGUF metadata and would drop the bias tensors.
    return load_reference(tiny_gguf[0], attention_bias=True)


def test_tiny_gguf_covers_every_required_quant_type(tiny_gguf):
    written = {t.name: t.tensor_type for t in gguf.GGUFReader(str(tiny_gguf[0])).tensors}
    assert written == QUANT_TYPES
    assert set(written.values()) == {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K,
                                     Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS}


def test_tiny_gguf_config(tiny_llm):
    arch = tiny_llm.runtime.loaded.arch
    assert (arch.model_type, arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (
        "llama", VOCAB, HIDDEN, INTERMEDIATE,
    )
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (LAYERS, HEADS, KV_HEADS, 64)
    assert not arch.tie_word_embeddings
    assert (arch.qkv_bias, arch.o_bias, arch.mlp_bias) == (True, True, False)
    assert arch.rms_norm_eps == pytest.approx(1e-5)
    assert arch.rope.theta == 10000.0
    assert arch.max_position_embeddings == 512


# Largest error of one de-quantized value, relative to the tensor's largest magnitude.
_QUANT_ERROR = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 4e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1, Q.Q5_0: 0.08, Q.Q5_1: 0.05}


def test_tiny_gguf_weights_close_to_their_source(tiny_gguf):
    """Without transformers: each tensor made from known values comes back in HF layout.

    A q/k row order left interleaved, or a tensor under the wrong name, is off by the weights' own
    size, far past any quantization error.
    """
    path, sources = tiny_gguf
    reader = open_gguf(path)
    cfg = read_gguf_config(reader, str(path))
    names = []
    for hf_name, weight in iter_gguf_weights(reader, cfg, torch.float32, str(path)):
        names.append(hf_name)
        if hf_name not in sources:
            continue  # random raw blocks: nothing to compare with but transformers (below)
        source = torch.from_numpy(sources[hf_name])
        assert weight.shape == source.shape, hf_name
        error = ((weight - source).abs().max() / source.abs().max()).item()
        qtype = QUANT_TYPES[gguf_name(hf_name)]
        assert error <= _QUANT_ERROR[qtype], f"{hf_name} ({qtype.name}): relative error {error:.2e}"
    assert sorted(gguf_name(n) for n in names) == sorted(QUANT_TYPES)
    assert {QUANT_TYPES[gguf_name(n)] for n in sources} == set(_QUANT_ERROR)


def test_tiny_gguf_weights_identical_to_transformers(tiny_llm, tiny_reference):
    assert_same_weights(tiny_llm, tiny_reference)


def test_tiny_gguf_logits_match_transformers(tiny_llm, tiny_reference):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 7, 23, 40)]
    ours = prefill_logits(tiny_llm, prompts)
    expected = reference_last_logits(tiny_reference, prompts)
    scale = expected.abs().max().item()
    diff = (ours - expected).abs().max().item()
    assert scale > 1.0  # logits that say something, so that greedy decoding below means something
    assert diff <= 1e-4 * scale, f"max abs logit diff {diff:.2e} at logit scale {scale:.2f}"


def test_tiny_gguf_greedy_matches_transformers(tiny_llm, tiny_reference):
    prompts = ["The quick brown fox", "def add(a, b):", "Paged attention stores keys and values"]
    outputs = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for request in outputs:
        out = request.outputs[0]
        assert out.finish_reason == "length"
        assert out.token_ids == reference_greedy(tiny_reference, request.prompt_token_ids, 16), request.prompt


def test_tiny_gguf_runs_every_quantized_type_on_the_kernels(tiny_gguf, kernels):
    """At bfloat16 with quantization auto, each quantized type of the file runs on the kernels,
    packed (q/k/v and gate/up fused across types), and the logits stay near the exact float32 model's:
    int8 activations move them by about 2% of their range here."""
    from model_forward import prefill_logits as forward_logits

    from cadenza.models.quantized_linear import block_layouts

    native = load_model(tiny_gguf[0], dtype=torch.bfloat16, cpu_kernels="on", quantization="auto")
    exact = load_model(tiny_gguf[0], dtype=torch.float32, cpu_kernels="on", quantization="none")
    layouts = block_layouts(native.model, native.model.kernels)
    quantized = {q.name for q in QUANT_TYPES.values() if q not in (Q.F32, Q.F16, Q.BF16)}
    assert {e["type"] for e in layouts} == quantized and all(e["packed"] for e in layouts)
    g = torch.Generator().manual_seed(0)
    for n in (1, 23):
        ids = torch.randint(3, 300, (n,), generator=g).tolist()
        got, expected = forward_logits(native, ids)[-1], forward_logits(exact, ids)[-1]
        assert (got - expected).abs().max() < 0.05 * expected.abs().max()


# ---------------------------------------------------------------------------------------------
def test_a_type_without_a_kernel_is_a_warning_with_its_cost(tmp_path, monkeypatch):
    """A type gguf's reference reads but no kernel does loads de-quantized: never silently. Every
    type we load has a kernel now, so Q5_0 plays one here, as a build without its kernel would see it."""
    from structlog.testing import capture_logs

    from cadenza.models import gguf_loader
    from cadenza.models.gguf_file import GGUFFile

    path = tmp_path / "q5_0.gguf"
    write_tiny_llama_gguf(path, {**QUANT_TYPES, "blk.1.ffn_up.weight": Q.Q5_0})
    assert "model.layers.1.mlp.up_proj.weight" in gguf_loader.plan_native_weights(GGUFFile(path), None)
    monkeypatch.delitem(gguf_loader.NATIVE_TYPES, int(Q.Q5_0))
    with capture_logs() as logs:
        kept = gguf_loader.plan_native_weights(GGUFFile(path), None)
    assert "model.layers.1.mlp.up_proj.weight" not in kept and "model.layers.1.mlp.down_proj.weight" in kept
    [warning] = [e for e in logs if e["log_level"] == "warning"]
    assert warning["type"] == "Q5_0" and warning["names"] == ["blk.0.ffn_gate.weight", "blk.1.ffn_up.weight"]
    # Two 512 x 256 weights: 22 bytes a block of 32 in the file, 2 bytes a value as bfloat16.
    assert warning["file_mib"] == round(2 * 512 * 256 / 32 * 22 / 2**20, 1) and warning["bf16_mib"] == 0.5
    assert not [e for e in logs if e["log_level"] == "warning" and e.get("type") != "Q5_0"]


# Files we must refuse, each with a message that says what is wrong and where.


def test_unsupported_quant_type_names_tensor_and_type(tmp_path):
    path = tmp_path / "iq2.gguf"
    # IQ2_XXS blocks, which gguf could even de-quantize; we do not claim the type.
    write_tiny_llama_gguf(path, {**QUANT_TYPES, "blk.1.ffn_up.weight": Q.IQ2_XXS})
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ffn_up\.weight.*IQ2_XXS") as info:
        load_model(path, dtype=torch.float32)
    assert str(path) in str(info.value)
    assert "Q4_K" in str(info.value)  # and lists the supported ones


@pytest.mark.parametrize("architecture", ["gpt2", "bert"])
def test_unsupported_architecture_is_named(tmp_path, architecture):
    path = tmp_path / f"{architecture}.gguf"
    write_tiny_llama_gguf(path, architecture=architecture)
    with pytest.raises(UnsupportedModelError, match=rf"unsupported GGUF architecture '{architecture}'") as info:
        load_model(path, dtype=torch.float32)
    assert str(path) in str(info.value)
    assert "llama" in str(info.value)  # and lists the supported ones


@pytest.mark.parametrize("cut", ["empty", "header", "metadata", "tensor-data", "last-byte"])
def test_truncated_file_names_path(tiny_gguf, tmp_path, cut):
    data = tiny_gguf[0].read_bytes()
    data_start = gguf.GGUFReader(str(tiny_gguf[0])).data_offset
    keep = {
        "empty": 0, "header": 10, "metadata": data_start // 2,
        "tensor-data": (data_start + len(data)) // 2, "last-byte": len(data) - 1,
    }[cut]
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:keep])
    with pytest.raises(ModelLoadError, match=re.escape(str(path))):
        load_model(path, dtype=torch.float32)


def test_corrupt_file_names_path(tmp_path):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"this is not a GGUF file, only text with the suffix" * 100)
    with pytest.raises(ModelLoadError, match=re.escape(str(path))):
        load_model(path, dtype=torch.float32)


def test_missing_file_names_path(tmp_path):
    path = tmp_path / "no-such-model.gguf"
    with pytest.raises(ModelLoadError, match=re.escape(str(path))):
        LLM(path, dtype="float32")
