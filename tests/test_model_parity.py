"""cadenza's decoder against transformers on the same random weights (fp32).

Logits must agree to 1e-4 for prefill and for every decode step through the paged KV cache, and
greedy generation must give identical tokens, for batches that mix prompt lengths (some longer than
a block), chunked prefills and decodes in one step.
"""

import pytest
import torch
import transformers

from cadenza import LLM, SamplingParams
from cadenza.kernels.cpu.features import cpu_has_avx2_fma
from cadenza.runner.model_runner import ScheduledChunk

BLOCK = 8
TOLERANCE = 1e-4
PROMPT_LENGTHS = [3, 17, 40, 9, 1]


def load_reference(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run the full length, as ignore_eos does
    model.generation_config.pad_token_id = 0
    return model


def random_prompts(seed, lengths, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def reference_logits(model, prompt, continuation):
    """transformers' logits at the last prompt position and at every continuation position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(continuation)]


def reference_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


# cpu_kernels "auto" runs cadenza's CPU kernels where they build (x86-64 with AVX2, as on CI);
# "off" is the pure PyTorch path. Both must match transformers.
@pytest.mark.parametrize("backend,cpu_kernels", [("torch_sdpa", "auto"), ("torch_sdpa", "off"), ("eager", "auto")])
def test_logits_match_through_paged_cache(tiny_model_dir, arch, backend, cpu_kernels):
    path = tiny_model_dir(arch)
    llm = LLM(path, dtype="float32", block_size=BLOCK, num_blocks=128, attention_backend=backend,
              cpu_kernels=cpu_kernels)
    if cpu_kernels == "off" or not cpu_has_avx2_fma():
        assert llm.runtime.loaded.model.kernels is None
    else:
        assert llm.runtime.loaded.model.kernels is not None
    runner = llm.runtime.runner
    prompts = random_prompts(1, PROMPT_LENGTHS)
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    ours: list[list[torch.Tensor]] = [[] for _ in prompts]

    def step(chunks):
        result = runner.execute(chunks, return_logits=True)
        for row, request_id in enumerate(result.request_ids):
            i = int(request_id)
            ours[i].append(result.logits[row])
            seqs[i].append(int(result.logits[row].argmax()))

    # Step 1: two whole prompts and the first chunk of a third (which samples nothing yet).
    step([
        ScheduledChunk("0", prompts[0], 0, tables[0]),
        ScheduledChunk("1", prompts[1], 0, tables[1]),
        ScheduledChunk("2", prompts[2][:21], 0, tables[2], sample=False),
    ])
    # Step 2: decodes beside the rest of the chunked prompt (after a cached prefix) and new prompts.
    step([
        ScheduledChunk("0", seqs[0][-1:], len(seqs[0]) - 1, tables[0]),
        ScheduledChunk("1", seqs[1][-1:], len(seqs[1]) - 1, tables[1]),
        ScheduledChunk("2", prompts[2][21:], 21, tables[2]),
        ScheduledChunk("3", prompts[3], 0, tables[3]),
        ScheduledChunk("4", prompts[4], 0, tables[4]),
    ])
    for _ in range(40):
        step([ScheduledChunk(str(i), s[-1:], len(s) - 1, tables[i]) for i, s in enumerate(seqs)])

    reference = load_reference(path)
    for i, prompt in enumerate(prompts):
        continuation = seqs[i][len(prompt) :]
        expected = reference_logits(reference, prompt, continuation[:-1])
        got = torch.stack(ours[i])
        assert got.shape == expected.shape
        diff = (got - expected).abs().max().item()
        assert diff < TOLERANCE, f"{arch}/{backend}/{cpu_kernels} sequence {i}: max abs logit diff {diff:.2e}"


def test_greedy_tokens_identical(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    # A small token budget and chunk size force chunked prefills mixed with decodes.
    llm = LLM(
        path, dtype="float32", block_size=BLOCK, num_blocks=256, max_num_batched_tokens=24, chunk_size=16
    )
    prompts = random_prompts(2, [5, 33, 12, 48, 2, 20])
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    reference = load_reference(path)
    for prompt, request in zip(prompts, outputs):
        out = request.outputs[0]
        assert out.finish_reason == "length"
        assert out.token_ids == reference_greedy(reference, prompt, 64)


def test_sharded_checkpoint_loads_identically(tiny_model_dir):
    whole = LLM(tiny_model_dir("llama3"), dtype="float32", num_blocks=32)
    sharded = LLM(tiny_model_dir("llama3", max_shard_size="100KB"), dtype="float32", num_blocks=32)
    assert len(list(tiny_model_dir("llama3", max_shard_size="100KB").glob("*.safetensors"))) > 1
    for (name, a), (_, b) in zip(
        whole.runtime.loaded.model.state_dict().items(), sharded.runtime.loaded.model.state_dict().items()
    ):
        assert torch.equal(a, b), name


def test_bfloat16_stays_close_to_fp32(tiny_model_dir):
    path = tiny_model_dir("llama3")
    prompts = random_prompts(3, [30])
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    fp32 = LLM(path, dtype="float32", num_blocks=32).generate(prompts, params)[0].outputs[0]
    bf16 = LLM(path, dtype="bfloat16", num_blocks=32).generate(prompts, params)[0].outputs[0]
    best = min(fp32.logprobs[0].values(), key=lambda p: p.rank)
    assert best.decoded_token in {p.decoded_token for p in bf16.logprobs[0].values()}


@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_bfloat16_weights_compute_like_float32_on_the_same_weights(tiny_model_dir, cpu_kernels):
    # Where the CPU has no native bf16, bf16 weights multiply float32 activations (the kernel for a
    # few rows, the exact float32 copy for many): the logits are those of a float32 model whose
    # weights are the bf16 values, at every batch size. PyTorch's own bf16 product (kernels off)
    # rounds a few rows of activations to bf16 first, so it is only close.
    from cadenza.kernels.cpu.features import cpu_has_native_bf16

    if cpu_has_native_bf16():
        pytest.skip("bf16 weights compute in bf16 on this CPU")
    path = tiny_model_dir("qwen2")
    bf16 = LLM(path, dtype="bfloat16", block_size=BLOCK, num_blocks=128, cpu_kernels=cpu_kernels)
    fp32 = LLM(path, dtype="float32", block_size=BLOCK, num_blocks=128, cpu_kernels="off")
    model = bf16.runtime.loaded.model
    tolerance = TOLERANCE if model.kernels is not None else 0.2
    # With the kernels, steps under 128 rows run each layer as two fused calls (decode_layer.h).
    assert all((layer.fused is not None) == (model.kernels is not None) for layer in model.layers)
    with torch.no_grad():
        for param in fp32.runtime.loaded.model.parameters():
            param.copy_(param.bfloat16().float())
    prompts = random_prompts(4, [12, 30, 7, 19, 3])
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(len(prompts))]
    greedy = [list(p) for p in prompts]

    def both(chunks):
        a = bf16.runtime.runner.execute(chunks, return_logits=True).logits
        b = fp32.runtime.runner.execute(chunks, return_logits=True).logits
        assert (a - b).abs().max().item() < tolerance
        return b

    logits = both([ScheduledChunk(str(i), p, 0, tables[i]) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        greedy[i].append(int(logits[i].argmax()))
    for live in (5, 5, 3, 2, 1, 1):  # decode batches of 5 rows down to 1
        chunks = [ScheduledChunk(str(i), greedy[i][-1:], len(greedy[i]) - 1, tables[i]) for i in range(live)]
        logits = both(chunks)
        for i in range(live):
            greedy[i].append(int(logits[i].argmax()))
