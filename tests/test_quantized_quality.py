"""Quality end to end (issue 11): the embedded default model's perplexity on a fixed public-domain
text (tests/data/pride_and_prejudice_ch1.txt, 1,000 tokens), teacher-forced over the whole text.

The native path (quantization auto, bf16 dtype: the file's Q4_1 blocks through cadenza's kernels)
must score within 1% of the de-quantized float32 path of the same file (its exact weights). The
native path is fed 8 tokens a step over its KV cache, as decode steps and small prefill chunks run:
below GEMM_MIN_ROWS_BF16 rows every product, LM head included, takes the int8-activation kernels; a
second run feeds 256 tokens a step, the path prefill takes (each weight de-quantized for a GEMM,
bfloat16 on CPUs that multiply it natively, which rounds activations to bfloat16). Greedy agreement, the argmax of both paths at every position, is printed; only a floor is
asserted.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from model_forward import chunk_metadata

from cadenza.kernels.cpu import loader as cpu
from cadenza.kernels.cpu.features import cpu_has_avx2_fma

pytestmark = pytest.mark.skipif(not cpu_has_avx2_fma(), reason="the quantized kernels need x86-64 with AVX2 and FMA")

TEXT = Path(__file__).parent / "data" / "pride_and_prejudice_ch1.txt"
NATIVE_CHUNK = 8  # below GEMM_MIN_ROWS_BF16 (and GEMM_MIN_ROWS): the int8 kernels
EXACT_CHUNK = 256


@pytest.fixture(scope="module")
def default_models():
    """The embedded default model native (bf16 dtype, quantization auto) and de-quantized to float32."""
    from cadenza.models.loading import load_model
    from cadenza.models.quantized_linear import GEMM_MIN_ROWS_BF16

    module, why = cpu._build()
    if module is None:
        pytest.skip(f"the CPU kernels cannot be built here: {why}")
    assert NATIVE_CHUNK < GEMM_MIN_ROWS_BF16
    native = load_model(None, dtype=torch.bfloat16, cpu_kernels="on", quantization="auto")
    exact = load_model(None, dtype=torch.float32, cpu_kernels="on", quantization="none")
    return native, exact


def text_ids(tokenizer) -> list[int]:
    body = TEXT.read_text(encoding="utf-8").split("\n", 1)[1]  # the first line names the source
    return tokenizer.encode(body)


def next_token_scores(loaded, ids: list[int], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each actual next token, the argmax there) at positions 0 .. len(ids) - 2,
    the text fed `chunk` tokens a step over one sequence's cache (eager attention)."""
    from cadenza.attention_backends.eager import EagerBackend
    from cadenza.runner.kv_cache import allocate_kv_caches

    arch, block_size, n = loaded.arch, 16, len(ids) - 1  # the last token predicts nothing scored
    blocks = -(-n // block_size)
    caches = allocate_kv_caches(arch, blocks, block_size, loaded.compute_dtype, torch.device("cpu"))
    backend = EagerBackend(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                           scale=arch.softmax_scale, block_size=block_size, sliding_window=None)
    tokens = torch.tensor(ids)
    logprobs, argmax = [], []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        meta = chunk_metadata(start, end, blocks)
        hidden = loaded.model(tokens[start:end], torch.arange(start, end), caches, meta, backend)
        scores = loaded.model.compute_logits(hidden).float().log_softmax(-1)
        logprobs.append(scores.gather(1, tokens[start + 1 : end + 1, None])[:, 0])
        argmax.append(scores.argmax(-1))
    return torch.cat(logprobs), torch.cat(argmax)


@pytest.mark.parametrize("chunk", [NATIVE_CHUNK, EXACT_CHUNK], ids=["int8 kernels", "de-quantized GEMM"])
def test_native_perplexity_within_one_percent_of_dequantized(default_models, chunk):
    native, exact = default_models
    ids = text_ids(native.tokenizer)
    assert 600 <= len(ids) <= 1000
    native_lp, native_top = next_token_scores(native, ids, chunk)
    exact_lp, exact_top = next_token_scores(exact, ids, EXACT_CHUNK)
    native_ppl, exact_ppl = math.exp(-native_lp.double().mean()), math.exp(-exact_lp.double().mean())
    relative = native_ppl / exact_ppl - 1
    agreement = (native_top == exact_top).double().mean().item()
    print(f"\n{len(ids) - 1} tokens scored: perplexity native {native_ppl:.4f}, de-quantized fp32 {exact_ppl:.4f} "
          f"({relative:+.3%}); greedy agreement {agreement:.1%}")  # fmt: skip
    assert abs(relative) < 0.01
    assert agreement > 0.9
