"""The GPU's mixture of experts (kernels/triton/moe.py): every (token, expert) pair of a step in two
grouped GEMMs, run here under Triton's interpreter (natively where CUDA is present) against the
experts one by one."""

from __future__ import annotations

import pytest
import torch

from cadenza.models.loading import load_model
from tests.test_moe import mixtures
from tests.test_triton_ops import DEVICE, ON_GPU, _load_kernels

triton = pytest.importorskip("triton")
moe_kernels = _load_kernels("moe")


@pytest.mark.parametrize("tokens, top_k, experts, block_m", [(1, 2, 8, 16), (37, 4, 8, 16), (300, 2, 6, 64), (5, 3, 64, 16)])
def test_alignment_groups_every_pair_once_in_tiles_of_one_expert(tokens, top_k, experts, block_m):
    ids = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(tokens))
    alignment = moe_kernels.align_by_expert(ids.to(DEVICE), experts, block_m)
    pairs, tile_experts = alignment.sorted_pairs.cpu(), alignment.tile_experts.cpu()
    flat = ids.reshape(-1)
    real = pairs[pairs < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))  # each pair exactly once
    for tile, expert in enumerate(tile_experts.tolist()):
        members = pairs[tile * block_m : (tile + 1) * block_m]
        members = members[members < flat.numel()]
        if expert < 0:
            assert members.numel() == 0  # tiles past the end hold only padding
            continue
        assert (flat[members] == expert).all() and members.tolist() == sorted(members.tolist())  # token order
    assert pairs.numel() <= flat.numel() + experts * (block_m - 1) + block_m  # bounded by the step's shape


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_grouped_gemms_give_what_the_experts_one_by_one_give(tiny_model_dir, arch):
    """Routing weights, biases (gpt-oss) and each family's activation, for a decode-sized step and a
    prefill-sized one (whose tiles take many tokens an expert)."""
    loaded = load_model(tiny_model_dir(arch), dtype=torch.float32, device=DEVICE)
    moe = mixtures(loaded)[0]
    generator = torch.Generator().manual_seed(3)
    inputs = [(torch.randn(rows, loaded.arch.hidden_size, generator=generator).to(DEVICE),
               torch.randn(rows, loaded.arch.hidden_size, generator=generator).to(DEVICE)) for rows in (1, 5, 70)]
    with torch.no_grad():
        wants = [moe(x, residual.clone()) for x, residual in inputs]
        moe.use_grouped_gemm(moe_kernels)
        gots = [moe(x, residual.clone()) for x, residual in inputs]
        moe.grouped = None
        # The experts' weights are now views of the stacks: one by one, the same as before.
        agains = [moe(x, residual.clone()) for x, residual in inputs]
    for want, got, again in zip(wants, gots, agains):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again, want, rtol=0, atol=0)


@pytest.mark.skipif(not ON_GPU, reason="the model loads with grouped experts on CUDA only")
def test_a_mixture_on_cuda_loads_with_grouped_experts(tiny_model_dir):
    loaded = load_model(tiny_model_dir("qwen3_moe"), dtype=torch.bfloat16, device="cuda")
    assert all(moe.grouped is not None for moe in mixtures(loaded))
