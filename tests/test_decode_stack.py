"""The kernels' whole-step decode (`decode_stack_`, one call for every layer) against the layer-by-
layer loop it replaces: the same kernel calls in the same order, so the logits must be equal bit
for bit, on float32 and int8 KV caches, for sequences of different lengths in one batch."""

from __future__ import annotations

import pytest
import torch
from test_engine import make_runtime

from cadenza.attention_backends.torch_sdpa import STACK_MAX_QUERY_LEN, TorchSDPABackend
from cadenza.sampling_params import SamplingParams
from cadenza.step import ScheduledChunk

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module", params=["float32", "int8"])
def runtime(request, model_path):
    """The tiny model quantized to Q8_0 on load: every layer runs on the fused kernel."""
    rt = make_runtime(model_path, **{"model.quantization": "int8", "cache.dtype": request.param})
    if rt.loaded.model.fused_stack is None:
        pytest.skip("the CPU kernels are unavailable here")
    return rt


def _steps(runtime, prompts: list[list[int]], decode_steps: int, first_block: int) -> list[torch.Tensor]:
    """Logits of a prefill per prompt, then of `decode_steps` steps decoding every prompt at once."""
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    per_seq = -(-(max(map(len, prompts)) + decode_steps + 1) // runtime.block_size)
    tables = [list(range(first_block + i * per_seq, first_block + (i + 1) * per_seq)) for i in range(len(prompts))]
    ids = [f"s{first_block}-{i}" for i in range(len(prompts))]
    logits, last = [], []
    for rid, prompt, table in zip(ids, prompts, tables):
        result = runtime.runner.execute([ScheduledChunk(rid, prompt, 0, table, True, params, prompt)], return_logits=True)
        logits.append(result.logits)
        last.append(int(result.sampled.token_ids[0]))
    for step in range(decode_steps):
        chunks = [
            ScheduledChunk(rid, [token], len(prompt) + step, table, True, params, prompt)
            for rid, prompt, table, token in zip(ids, prompts, tables, last)
        ]
        result = runtime.runner.execute(chunks, return_logits=True)
        logits.append(result.logits)
        last = result.sampled.token_ids.tolist()
    runtime.runner.finish_requests(ids)
    return logits


def test_whole_step_decode_equals_the_layer_loop(runtime, monkeypatch):
    # Prompts longer than the whole-step path takes: their prefills run layer by layer either way.
    prompts = [[(5 * i) % 97 for i in range(30)], list(range(20, 60)), [3] * (STACK_MAX_QUERY_LEN + 1)]
    calls = []
    original = TorchSDPABackend.run_decode_stack

    def counted(self, *args):
        ran = original(self, *args)
        calls.append(ran)
        return ran

    monkeypatch.setattr(TorchSDPABackend, "run_decode_stack", counted)
    stacked = _steps(runtime, prompts, decode_steps=6, first_block=0)
    assert calls == [False] * 3 + [True] * 6  # every decode step ran as one call
    monkeypatch.setattr(TorchSDPABackend, "run_decode_stack", lambda self, *args: False)
    looped = _steps(runtime, prompts, decode_steps=6, first_block=64)
    assert len(stacked) == len(looped) == len(prompts) + 6
    for a, b in zip(stacked, looped):
        assert torch.equal(a, b)


def test_a_chunk_of_rows_equals_the_decode_steps_it_stands_for(runtime):
    """What speculative verification relies on: a chunk of k tokens after a prompt gives, row by
    row, the logits of the k decode steps that feed the same tokens one at a time, bit for bit, and
    a decoding neighbour in the same step keeps its logits."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt, follow = [7, 1, 8, 2, 8, 1, 8], [4, 5, 9, 0, 6]
    other, other_next = list(range(30, 50)), 11

    def run(first_block: int, chunked: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        a, b = f"a{first_block}", f"b{first_block}"
        ta, tb = list(range(first_block, first_block + 4)), list(range(first_block + 4, first_block + 8))
        runtime.runner.execute([ScheduledChunk(a, prompt, 0, ta, True, params, prompt)])
        runtime.runner.execute([ScheduledChunk(b, other, 0, tb, True, params, other)])
        neighbour = ScheduledChunk(b, [other_next], len(other), tb, True, params, other)
        if chunked:
            rows = runtime.runner.execute(
                [ScheduledChunk(a, follow, len(prompt), ta, True, params, prompt), neighbour], return_logits=True
            ).logits
            # logits: the sampled row of each chunk; the chunk's other rows come from the model directly.
            result = [rows[0]], rows[1]
        else:
            steps = [
                runtime.runner.execute([ScheduledChunk(a, [t], len(prompt) + i, ta, True, params, prompt)], return_logits=True).logits[0]
                for i, t in enumerate(follow)
            ]
            result = steps[-1:], runtime.runner.execute([neighbour], return_logits=True).logits[0]
        runtime.runner.finish_requests([a, b])
        return result

    decoded, decoded_neighbour = run(0, chunked=False)
    chunk, chunk_neighbour = run(32, chunked=True)
    assert torch.equal(chunk[0], decoded[0])  # the chunk's last row = the last of the decode steps
    assert torch.equal(chunk_neighbour, decoded_neighbour)


# Each family's options inside a layer: Qwen3's q/k norms, Gemma 3's norms around each block, GELU
# and local layers with their own rotary and window, Phi-4-mini's partial rotary, SmolLM3's NoPE
# layers, Granite's residual multiplier, gpt-oss's sinks (its attention half; experts apart).
@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "phi3", "smollm3", "granite", "gpt_oss"])
def test_each_familys_layer_options_run_inside_the_fused_layer(kernels, tiny_model_dir, arch):
    """The fused layer kernel (kernels/cpu/decode_layer.h) computes each family's layer: a step's
    logits equal the modules' one by one."""
    from model_forward import prefill_logits

    from cadenza.models.loading import load_model

    loaded = load_model(tiny_model_dir(arch), dtype=torch.bfloat16, quantization="int8", cpu_kernels="auto")
    assert all(layer.fused is not None for layer in loaded.model.layers)
    tokens = [7, 99, 123, 5, 17, 101, 33, 250, 7, 64, 12]  # longer than Gemma's tiny window of 8
    fused = prefill_logits(loaded, tokens)
    kept = [(layer.fused, layer.fused_max_rows) for layer in loaded.model.layers]
    for layer in loaded.model.layers:
        layer.fused, layer.fused_max_rows = None, 0
    loaded.model.fused_stack = None
    one_by_one = prefill_logits(loaded, tokens)
    for layer, (fused_layer, rows) in zip(loaded.model.layers, kept):
        layer.fused, layer.fused_max_rows = fused_layer, rows
    torch.testing.assert_close(fused, one_by_one, rtol=1e-5, atol=1e-5)


def test_a_fused_projection_stored_in_two_block_types_runs_inside_the_fused_layer(kernels, tiny_model_dir):
    """llama-quantize's Q4_K_M stores half the layers' `attn_v` as Q6_K beside Q4_K q and k: the
    fused q/k/v then holds rows of two block types. The layer kernel takes it in parts (it left
    those layers, and the whole-step path, to the modules one by one): the logits equal theirs."""
    import gguf
    import numpy as np
    from model_forward import prefill_logits

    from cadenza.models.loading import load_model
    from cadenza.models.quantized_linear import QuantizedLinear, QuantizedTensor

    loaded = load_model(tiny_model_dir("llama2_bias"), dtype=torch.bfloat16, quantization="int8", cpu_kernels="auto")
    model, cfg = loaded.model, loaded.arch
    kv_rows = slice(cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size)
    for layer in model.layers[::2]:  # every other layer, as Q4_K_M does
        old = layer.self_attn.qkv_proj
        weight = torch.empty(old.out_features, old.in_features)
        kernels.quant_dequantize_(weight, *old.block_tensors(), old.parts[0][1])
        mixed = QuantizedLinear(old.in_features, old.out_features, bias=True)
        split = cfg.q_size + cfg.kv_size
        q8 = gguf.quants.quantize(weight[:split].numpy(), gguf.GGMLQuantizationType.Q8_0)
        q4 = gguf.quants.quantize(weight[kv_rows].numpy(), gguf.GGMLQuantizationType.Q4_0)
        mixed.load_rows(0, QuantizedTensor(torch.from_numpy(np.ascontiguousarray(q8)), 8, old.in_features))
        mixed.load_rows(split, QuantizedTensor(torch.from_numpy(np.ascontiguousarray(q4)), 2, old.in_features))
        mixed.finish_loading()
        mixed.bias = old.bias
        layer.self_attn.qkv_proj = mixed
    model.use_cpu_kernels(kernels)
    assert [len(layer.self_attn.qkv_proj.parts) for layer in model.layers] == [2, 1]
    assert all(layer.fused is not None for layer in model.layers) and model.fused_stack is not None
    tokens = [7, 99, 123, 5, 17, 101, 33]
    fused = prefill_logits(loaded, tokens)
    for layer in model.layers:
        layer.fused, layer.fused_max_rows = None, 0
    model.fused_stack = None
    torch.testing.assert_close(fused, prefill_logits(loaded, tokens), rtol=1e-5, atol=1e-5)
