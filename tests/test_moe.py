"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE, gpt-oss): routing as transformers routes, only the picked
experts read, quantized experts on the packed kernels and the experts kernel.

Logits and greedy tokens against transformers, through the paged cache and mixed batches, are in
test_model_parity.py (the three families are among its architectures); each family's GGUF, made by
llama.cpp's converter, in test_families.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from cadenza.models.llama import MLP
from cadenza.models.loading import load_model
from cadenza.models.moe import SparseMoE
from cadenza.models.quantized_linear import PACKED_FLAG, QuantizedLinear
from tests.model_forward import prefill_logits
from tests.tiny_models import build_tiny_model

MOE_ARCHS = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")
PROMPT = [5, 17, 101, 33, 250, 7, 64, 12, 199, 3, 80, 41, 9, 300, 2, 77]


def reference_logits(directory, tokens: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def mixtures(loaded) -> list[SparseMoE]:
    return [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, SparseMoE)]


def routed_logits(loaded, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits, each mixture's experts for each token, sorted: [layers, tokens, k])."""
    routes = []
    for moe in mixtures(loaded):
        def route(x, original=moe.route):
            weights, experts = original(x)
            routes.append(experts.sort(dim=-1).values)
            return weights, experts

        moe.route = route
    logits = prefill_logits(loaded, tokens)
    for moe in mixtures(loaded):
        del moe.route
    return logits, torch.stack(routes)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_the_config_reads_as_a_mixture(tiny_model_dir, arch):
    loaded = load_model(tiny_model_dir(arch), dtype=torch.float32)
    moe = loaded.arch.moe
    assert (moe.num_experts, moe.top_k) == (8, 2)
    # The tiny Qwen3-MoE leaves layer 1 dense (mlp_only_layers), as Qwen's configs can.
    assert moe.layers == ((0,) if arch == "qwen3_moe" else (0, 1))
    assert len(mixtures(loaded)) == len(moe.layers)
    assert mixtures(loaded)[0].gate.weight.dtype == torch.float32


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_ties_in_the_router_break_as_transformers_breaks_them(tmp_path, arch):
    """A router of zeros gives every expert the same probability: `topk` then picks by its own
    tie rule, and the same experts must run in both engines."""
    directory = build_tiny_model(tmp_path / arch, arch)
    from safetensors.torch import load_file, save_file

    weights = load_file(directory / "model.safetensors")
    for name in weights:
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight", "mlp.router.bias")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    want = reference_logits(directory, PROMPT)
    got = prefill_logits(load_model(directory, dtype=torch.float32), PROMPT)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_one_token_runs_only_the_experts_it_picked(tiny_model_dir):
    loaded = load_model(tiny_model_dir("mixtral"), dtype=torch.float32)
    ran: list[tuple[int, int]] = []  # (layer, expert) each time an expert computes
    routed: list[tuple[int, int]] = []  # (layer, expert) for each pick of the router
    for index, moe in enumerate(mixtures(loaded)):
        def route(x, original=moe.route, layer=index):
            weights, experts = original(x)
            routed.extend((layer, int(e)) for e in experts.flatten())
            return weights, experts

        moe.route = route
        for number, expert in enumerate(moe.experts):
            def counted(x, original=expert.hidden, key=(index, number)):
                ran.append(key)
                return original(x)

            expert.hidden = counted
    prefill_logits(loaded, [42])
    assert len(ran) == 2 * len(mixtures(loaded))
    assert sorted(ran) == sorted(routed)  # the two picked a layer, each once, and no other
    # A prompt of many tokens runs each picked expert once, over all of its tokens.
    ran.clear()
    routed.clear()
    prefill_logits(loaded, PROMPT)
    assert sorted(ran) == sorted(set(routed))


def test_grouped_tokens_give_what_each_token_alone_gives(tiny_model_dir):
    """A step of many tokens groups them by expert; one token at a time takes the direct path.
    The two must agree (float32, to rounding)."""
    loaded = load_model(tiny_model_dir("qwen3_moe"), dtype=torch.float32)
    moe = mixtures(loaded)[0]
    x = torch.randn(12, loaded.arch.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        together = moe(x, torch.zeros_like(x))
        alone = torch.cat([moe(x[i : i + 1], torch.zeros(1, x.shape[1])) for i in range(x.shape[0])])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_experts_quantized_on_load_run_packed_close_to_float(kernels, tiny_model_dir):
    directory = tiny_model_dir("qwen3_moe")
    exact = load_model(directory, dtype=torch.float32)
    int8 = load_model(directory, dtype=torch.bfloat16, quantization="int8", cpu_kernels="auto")
    experts = [e for moe in mixtures(int8) for e in moe.experts]
    assert experts and all(isinstance(e.gate_up_proj, QuantizedLinear) and isinstance(e.down_proj, QuantizedLinear)
                           for e in experts)
    if kernels.quant_packs(8):
        assert all(q & PACKED_FLAG for e in experts for _, q in e.gate_up_proj.parts)
    assert all(isinstance(moe.gate, torch.nn.Linear) and moe.gate.weight.dtype == torch.float32 for moe in mixtures(int8))
    (want, exact_routes), (got, int8_routes) = routed_logits(exact, PROMPT), routed_logits(int8, PROMPT)
    # A token the rounding sends to another expert gets another function of its input (measured:
    # 1 of 16 here, 31% off); the others are off by the weights' and activations' rounding only:
    # Q8_0 weights and int8 activations, as for the dense models (test_int8_weights.py: 2.5-5.2%).
    same = (exact_routes == int8_routes).all(dim=(0, 2))
    assert same.sum() >= 0.75 * len(PROMPT)
    error = (got - want)[same].norm() / want[same].norm()
    assert error < 0.08


def test_a_dense_mlp_layer_beside_experts_stays_an_mlp(tiny_model_dir):
    loaded = load_model(tiny_model_dir("qwen3_moe"), dtype=torch.float32)
    assert isinstance(loaded.model.layers[1].mlp, MLP) and not isinstance(loaded.model.layers[1].mlp, SparseMoE)
    assert loaded.model.layers[1].mlp.intermediate == 128  # the dense width, not the experts' 64
    assert mixtures(loaded)[0].experts[0].intermediate == 64


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_the_experts_kernel_gives_what_the_experts_one_by_one_give(kernels, tiny_model_dir, arch):
    """Decode-sized steps run all of a step's experts in one kernel call (kernels/cpu/moe.h); the
    same products one expert at a time from Python must agree, for one token and for several
    (some experts then shared by tokens); gpt-oss's with its biases and clamped SwiGLU."""
    loaded = load_model(tiny_model_dir(arch), dtype=torch.bfloat16, quantization="int8", cpu_kernels="auto")
    moe = mixtures(loaded)[0]
    assert moe.fused is not None and moe.fused_max_rows >= 8
    generator = torch.Generator().manual_seed(5)
    for rows in (1, 3, 8):
        x = torch.randn(rows, loaded.arch.hidden_size, generator=generator)
        residual = torch.randn(rows, loaded.arch.hidden_size, generator=generator)
        with torch.no_grad():
            fused = moe(x, residual.clone())
            kernel, moe.fused = moe.fused, None
            try:
                one_by_one = moe(x, residual.clone())
            finally:
                moe.fused = kernel
        torch.testing.assert_close(fused, one_by_one, rtol=1e-5, atol=1e-5)
        assert not torch.equal(fused, residual)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_tokens_experts_give_the_same_bits_alone_in_a_step_and_on_one_thread(kernels, tiny_model_dir, arch):
    """In decode-sized steps each token adds its experts' outputs in the order of its picks: a
    token's sum is bit for bit the same alone, in a step of 8 whose tokens share experts (which
    then run in another order), and with one thread or two."""
    loaded = load_model(tiny_model_dir(arch), dtype=torch.bfloat16, quantization="int8", cpu_kernels="auto")
    moe = mixtures(loaded)[0]
    generator = torch.Generator().manual_seed(11)
    rows, k, experts = 8, moe.top_k, len(moe.experts)
    x = torch.randn(rows, loaded.arch.hidden_size, generator=generator)
    residual = torch.randn(rows, loaded.arch.hidden_size, generator=generator)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(rows)])
    weights = torch.rand(rows, k, generator=generator)
    assert len(set(ids.flatten().tolist())) < rows * k  # some experts serve several tokens
    together = moe.fused.add_(residual.clone(), x, ids, weights)
    for t in range(rows):
        alone = moe.fused.add_(residual[t : t + 1].clone(), x[t : t + 1].clone(), ids[t : t + 1].clone(),
                               weights[t : t + 1].clone())
        assert torch.equal(alone, together[t : t + 1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(moe.fused.add_(residual.clone(), x, ids, weights), together)
    finally:
        torch.set_num_threads(threads)


def test_the_experts_kernel_refuses_a_bad_expert_id(kernels, tiny_model_dir):
    loaded = load_model(tiny_model_dir("mixtral"), dtype=torch.bfloat16, quantization="int8", cpu_kernels="auto")
    moe = mixtures(loaded)[0]
    x = torch.zeros(1, loaded.arch.hidden_size)
    with pytest.raises(RuntimeError, match="expert id 8 out of 8"):
        moe.fused.add_(x.clone(), x, torch.tensor([[0, 8]]), torch.ones(1, 2))


def test_a_mixture_layer_fuses_its_attention_half(kernels, tiny_model_dir):
    """A mixture's layer runs its attention through the fused layer kernel (norms, q/k norms,
    rotary, o_proj in two calls) and its experts apart; logits equal the modules' one by one."""
    loaded = load_model(tiny_model_dir("qwen3_moe"), dtype=torch.bfloat16, quantization="int8", cpu_kernels="auto")
    layers = loaded.model.layers
    assert layers[0].fused is not None and not layers[0].fused.has_mlp  # the mixture's layer: attention only
    assert layers[1].fused is not None and layers[1].fused.has_mlp  # the dense layer: whole
    assert loaded.model.fused_stack is None  # a stack needs whole layers
    tokens = [7, 99, 123]
    fused = prefill_logits(loaded, tokens)
    kept = [(layer.fused, layer.fused_max_rows) for layer in layers]
    for layer in layers:
        layer.fused, layer.fused_max_rows = None, 0
    one_by_one = prefill_logits(loaded, tokens)
    for layer, (kernel, rows) in zip(layers, kept):
        layer.fused, layer.fused_max_rows = kernel, rows
    torch.testing.assert_close(fused, one_by_one, rtol=1e-5, atol=1e-5)


def test_experts_kept_on_the_host_take_the_devices_activations_and_give_back_the_same(kernels, tiny_model_dir):
    """`model.moe_experts_on: cpu` (llama.cpp's --cpu-moe): the experts stay on the CPU in their own
    dtype (float32 for quantized blocks) while the rest runs elsewhere in another. A step's
    activations go to the host and the output comes back: here bfloat16 activations against the
    same experts given float32 directly."""
    loaded = load_model(tiny_model_dir("qwen3_moe"), dtype=torch.bfloat16, quantization="int8", cpu_kernels="auto")
    moe = mixtures(loaded)[0]
    moe.keep_experts_on_host(kernels)
    assert moe.on_host and moe.fused is not None
    generator = torch.Generator().manual_seed(7)
    for rows in (1, 6):
        x = torch.randn(rows, loaded.arch.hidden_size, generator=generator).bfloat16()
        residual = torch.randn(rows, loaded.arch.hidden_size, generator=generator).bfloat16()
        with torch.no_grad():
            got = moe(x, residual.clone())
            want = moe(x.float(), residual.float())  # float32 on the CPU: the experts' own path
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)  # bfloat16's rounding of the sum


def test_experts_kept_on_the_host_are_allocated_there_and_the_rest_on_the_device():
    from cadenza.models.llama import LlamaForCausalLM
    from cadenza.models.loading import _materialize
    from cadenza.models.moe import SparseMoE

    with torch.device("meta"):
        model = LlamaForCausalLM(load_model_arch("qwen3_moe"), max_positions=1)
    model = _materialize(model, torch.device("meta"), host_experts=True)  # meta stands in for a GPU
    moe = next(m for m in model.modules() if isinstance(m, SparseMoE))
    assert all(p.device.type == "cpu" for p in moe.experts.parameters())
    assert moe.gate.weight.device.type == "meta" and model.embed_tokens.weight.device.type == "meta"
    assert all(p.device.type == "meta" for p in model.layers[0].self_attn.parameters())


def load_model_arch(arch: str):
    import transformers

    from cadenza.models.config import ModelArchConfig
    from tests.tiny_models import _COMMON, ARCHITECTURES

    cls, extra = ARCHITECTURES[arch]
    return ModelArchConfig.from_hf(getattr(transformers, cls)(**{**_COMMON, **extra}).to_dict())
