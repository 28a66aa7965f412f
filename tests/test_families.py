"""Each family's GGUF, as llama.cpp's own `convert_hf_to_gguf.py` writes it, computes what the
family's Hugging Face checkpoint computes in transformers; its Q8_0 file runs on the kernels.

(Logits and greedy tokens of each family's Hugging Face directory against transformers, through
the paged cache, are in test_model_parity.py; the mixtures' routing and kernels in test_moe.py.)
"""

from __future__ import annotations

import contextlib
import json
import socket

import pytest
import torch
import transformers

from cadenza.models.loading import load_model
from cadenza.models.quantized_linear import QuantizedLinear
from tests.model_forward import prefill_logits
from tests.tiny_models import build_tiny_model, build_tokenizer

PROMPT = [5, 17, 101, 33, 250, 7, 64, 12, 199, 3, 80, 41, 9, 290, 2, 77]

# What llama.cpp's converter and graph need of the checkpoint: SmolLM3's graph leaves every fourth
# layer without rotary (whatever the config says), so the file is made with 4 layers at its default.
CONVERTIBLE = {
    "smollm3": dict(num_hidden_layers=4, no_rope_layer_interval=4),
    "granite": {},
    # llama.cpp computes LongRoPE's attention factor itself (from the context's growth), so the
    # checkpoint leaves it to be computed too; served within the original context (short factors).
    "phi3": dict(original_max_position_embeddings=64, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}),
    # Mixtures of experts: llama.cpp's converter has no dense layers beside experts for Qwen3-MoE,
    # and writes OLMoE's norm epsilon as 1e-5 whatever the config says.
    "qwen3_moe": dict(mlp_only_layers=[]),
    "mixtral": {},
    "olmoe": dict(rms_norm_eps=1e-5, num_key_value_heads=4),  # llama.cpp's OLMoE has no GQA (nor has OLMoE-1B-7B)
    # llama.cpp's graph makes every sixth layer global (the converter writes no pattern), and its
    # converter trims the embedding to the tokenizer's size: the checkpoint has no padding rows.
    "gemma3": dict(num_hidden_layers=6, sliding_window_pattern=6, vocab_size=len(build_tokenizer())),
    # llama.cpp's graph fixes the SwiGLU's clamp at 7 and rounds YaRN's ramp to whole dimensions
    # (transformers' `truncate`), and its converter trims the embedding to the tokenizer's size.
    "gpt_oss": dict(swiglu_limit=7.0, vocab_size=len(build_tokenizer()), rope_parameters={
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": True, "original_max_position_embeddings": 64}),
}
MAX_MODEL_LEN = {"phi3": 64}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from cadenza.bench.peers.convert import convert_hf_to_gguf

    made = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(f"{arch}-gguf")
            directory = build_tiny_model(root / "hf", arch, **CONVERTIBLE[arch])
            if arch == "phi3":  # Phi-4-mini's tokenizer is GPT-2's kind, which the converter reads as BPE
                config_file = directory / "tokenizer_config.json"
                config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
            files = [convert_hf_to_gguf(directory, root / f"{arch}-{kind}.gguf", kind, pre_tokenizer="qwen2")
                     for kind in ("f32", "q8_0")]
            made[arch] = (directory, *files)
        return made[arch]

    return get


@pytest.mark.parametrize("arch", sorted(CONVERTIBLE))
def test_the_gguf_of_llamacpps_converter_computes_as_transformers(converted, arch):
    directory, f32, _ = converted(arch)
    from_gguf = load_model(f32, dtype=torch.float32, max_model_len=MAX_MODEL_LEN.get(arch))
    from_hf = load_model(directory, dtype=torch.float32, max_model_len=MAX_MODEL_LEN.get(arch))
    assert from_gguf.arch.model_type == from_hf.arch.model_type
    assert (from_gguf.arch.rope.theta, from_gguf.arch.rope.rope_type) == (from_hf.arch.rope.theta, from_hf.arch.rope.rope_type)
    assert from_gguf.arch.rope.attention_factor == pytest.approx(from_hf.arch.rope.attention_factor)
    local = [(r.theta, r.rope_type) if r else None for r in (from_gguf.arch.local_rope, from_hf.arch.local_rope)]
    assert local[0] == local[1]
    for option in ("rope_layers", "embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier",
                   "rotary_dim", "sliding_window", "layer_windows", "hidden_act", "sandwich_norms", "moe"):
        assert getattr(from_gguf.arch, option) == pytest.approx(getattr(from_hf.arch, option)), option
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(prefill_logits(from_gguf, PROMPT), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", sorted(CONVERTIBLE))
def test_a_q8_0_gguf_runs_on_the_kernels_close_to_its_exact_values(kernels, converted, arch):
    _, _, q8 = converted(arch)
    limit = MAX_MODEL_LEN.get(arch)
    native = load_model(q8, dtype=torch.bfloat16, quantization="auto", cpu_kernels="auto", max_model_len=limit)
    assert sum(isinstance(m, QuantizedLinear) for m in native.model.modules()) >= 4 * native.arch.num_layers
    exact = load_model(q8, dtype=torch.float32, max_model_len=limit)
    if native.arch.moe is None:
        want, got = prefill_logits(exact, PROMPT), prefill_logits(native, PROMPT)
    else:  # a token the rounding sends to other experts computes another function: compare the others
        from test_moe import mixtures, routed_logits

        assert all(isinstance(e.down_proj, QuantizedLinear) for moe in mixtures(native) for e in moe.experts)
        (want, want_routes), (got, got_routes) = routed_logits(exact, PROMPT), routed_logits(native, PROMPT)
        same = (want_routes == got_routes).all(dim=(0, 2))
        assert same.sum() >= 0.75 * len(PROMPT)
        want, got = want[same], got[same]
    error = (got - want).norm() / want.norm()
    assert error < 0.05  # the activations' int8 rounding (or a bf16 GEMM's) only


def test_the_shape_options_read_from_each_config():
    from tests.tiny_models import _COMMON, ARCHITECTURES

    def arch_of(name: str, **overrides):
        from cadenza.models.config import ModelArchConfig

        cls, extra = ARCHITECTURES[name]
        return ModelArchConfig.from_hf(getattr(transformers, cls)(**{**_COMMON, **extra, **overrides}).to_dict())

    granite = arch_of("granite")
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.logits_scaling) == (12.0, 0.22, 8.0)
    assert granite.softmax_scale == 0.0625
    assert arch_of("llama3").softmax_scale == 16**-0.5 and arch_of("llama3").rope_layers is None
    assert arch_of("smollm3").rope_layers == (True, False)  # every second layer NoPE in the tiny one
    assert arch_of("smollm3", no_rope_layer_interval=4).rope_layers is None  # 2 layers: both rotate


@pytest.mark.parametrize("max_model_len, length", [(64, 40), (512, 100)])
def test_longrope_uses_the_factors_of_the_context_served(tmp_path, max_model_len, length):
    """Phi-3.5/Phi-4-mini's LongRoPE: served within the original context (64 here), the short
    factors; served longer, the long ones at every position (as llama.cpp does). transformers
    picks by the sequence's own length, so a prompt within the original context agrees with the
    first and a longer one with the second."""
    directory = build_tiny_model(tmp_path / "phi3", "phi3", original_max_position_embeddings=64,
                                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                               "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]})
    loaded = load_model(directory, dtype=torch.float32, max_model_len=max_model_len)
    assert loaded.arch.rotary_dim == 12 and loaded.arch.rope.attention_factor == pytest.approx((1 + 3 / 6) ** 0.5)
    tokens = torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(2)).tolist()
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(prefill_logits(loaded, tokens), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", sorted(CONVERTIBLE))
def test_llamacpp_on_the_same_file_gives_the_same_next_token_probabilities(converted, arch):
    """llama.cpp's own server on each converted F32 file: its most likely next tokens after the
    prompt, and their log-probabilities, are cadenza's to 5e-3 (llama.cpp keeps its KV cache in
    float16). Both serve 256 positions: llama.cpp pads a context to a multiple of 256, so its
    Phi-3 takes LongRoPE's long factors even at -c 64 (beyond the tiny file's original 64), and
    cadenza takes them for a context of 256 too. Skipped where llama.cpp is not built
    (`python -m cadenza.bench.peers.llamacpp_build`)."""
    _, f32, _ = converted(arch)
    ours = torch.log_softmax(prefill_logits(load_model(f32, dtype=torch.float32, max_model_len=256), PROMPT)[-1], -1)
    assert_llamacpp_agrees(f32, PROMPT, ours, 256)


def assert_llamacpp_agrees(path, prompt: list[int], ours: torch.Tensor, context: int, tolerance: float = 5e-3) -> None:
    """llama-server on `path` gives `ours` (log-probabilities after `prompt`)'s greedy next token,
    and its top log-probabilities within `tolerance`; skips where llama.cpp is not built."""
    import os
    import signal
    import subprocess

    import httpx

    from cadenza.bench.peers.llamacpp_build import find_binary, why_binaries_missing
    from tests.server_process import wait_for

    binary = find_binary("llama-server")
    if binary is None:
        pytest.skip(why_binaries_missing() or "llama-server is not built")
    with socket_port() as port:
        process = subprocess.Popen([str(binary), "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-t", "2",
                                    "-c", str(context), "--no-webui"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(base + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return process.poll() is not None

        assert wait_for(healthy, timeout=60) and process.poll() is None, "llama-server did not start"
        body = {"prompt": prompt, "n_predict": 1, "n_probs": 5, "temperature": 0, "return_tokens": True}
        answer = httpx.post(base + "/completion", json=body, timeout=60).json()
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert answer["tokens"] == [int(ours.argmax())]  # the greedy next token
    # llama-server withholds the probabilities of a token that ends inside a UTF-8 character.
    for first in answer.get("completion_probabilities") or []:
        for entry in first["top_logprobs"]:
            assert abs(ours[entry["id"]].item() - entry["logprob"]) < tolerance, (entry, ours[entry["id"]].item())


@contextlib.contextmanager
def socket_port():
    """A free loopback port (released for the server to bind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield port
