"""cadenza's CPU kernels (kernels/*.h, built through kernels/cpu/cpu_kernels.cpp) against PyTorch's reference ops, and their switch.

The kernels build on x86-64 with AVX2/FMA (CI's machines); elsewhere these tests skip, and the
engine falls back to PyTorch ops (checked by `test_configure_falls_back_where_unavailable`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cadenza.attention_backends.base import AttentionMetadata
from cadenza.attention_backends.eager import EagerBackend
from cadenza.kernels.cpu import loader as cpu
from cadenza.kernels.cpu.features import cpu_has_avx2_fma

pytestmark = pytest.mark.skipif(not cpu_has_avx2_fma(), reason="the CPU kernels need x86-64 with AVX2 and FMA")


@pytest.fixture(scope="module")
def kernels():
    return cpu.configure("on")


def _bf16(shape, gen):
    return torch.randn(shape, generator=gen).bfloat16()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (1536, 576), (100, 37), (8, 5)])
def test_linear_bf16_matches_float64_reference(kernels, rows, in_features, out_features):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = _bf16((out_features, in_features), gen)
    bias = torch.randn(out_features, generator=gen)
    expected = F.linear(x.double(), w.double(), bias.double())
    got = kernels.linear_bf16(x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    # float32 accumulation of in_features products: error grows with sqrt(in_features)
    assert (got.double() - expected).abs().max().item() < 2e-6 * in_features
    residual = torch.randn(rows, out_features, generator=gen)
    summed = kernels.linear_bf16_add_(residual.clone(), x, w, None)
    assert (summed.double() - (residual.double() + F.linear(x.double(), w.double()))).abs().max().item() < 2e-6 * in_features


def test_linear_bf16_takes_a_strided_row_view(kernels):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 200, generator=gen)
    x = wide[:, :96]  # rows 200 apart
    w = _bf16((40, 96), gen)
    assert torch.allclose(kernels.linear_bf16(x, w, None), F.linear(x, w.float()), atol=1e-5)


def test_linear_bf16_rejects_wrong_inputs(kernels):
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.linear_bf16(x, torch.randn(8, 16), None)
    with pytest.raises(RuntimeError, match="features"):
        kernels.linear_bf16(x, torch.randn(8, 12).bfloat16(), None)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.linear_bf16(x.double(), torch.randn(8, 16).bfloat16(), None)


@pytest.mark.parametrize("size", [576, 64, 13])
def test_rms_norm(kernels, size):
    gen = torch.Generator().manual_seed(size)
    x = torch.randn(7, 3, size, generator=gen) * 3
    w = torch.randn(size, generator=gen)
    expected = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.allclose(kernels.rms_norm(x, w, 1e-5), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 32, 12])
def test_rotary_in_place_on_a_fused_projection_view(kernels, head_dim):
    from cadenza.kernels.rotary import apply_rotary
    from cadenza.models.config import RopeConfig
    from cadenza.models.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(head_dim)
    heads, tokens = 5, 6
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 100)
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen)
    positions = torch.tensor([0, 1, 7, 50, 99, 3])
    view = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # rows (heads + 2) * head_dim apart
    expected = apply_rotary(view.clone(), *rope.cos_sin(positions, torch.float32))
    untouched = qkv[:, heads * head_dim :].clone()
    kernels.rotary_(view, positions, rope.cos_table, rope.sin_table)
    assert torch.allclose(view, expected, atol=1e-6)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.rotary_(view, torch.tensor([0, 1, 2, 3, 4, 100]), rope.cos_table, rope.sin_table)


def test_stream_read_reads_every_whole_chunk_once(kernels):
    """bench's memory bandwidth: every byte of each whole 64 KiB chunk read (its xor), the tail not."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 2**63, size=(3 << 16) // 8 + 5, dtype=np.int64)  # 3 chunks and a tail
    expected = np.bitwise_xor.reduce(data[: (3 << 16) // 8])
    assert kernels.stream_read(torch.from_numpy(data)) == int(expected)
    assert kernels.stream_read(torch.zeros(100, dtype=torch.uint8)) == 0  # under a chunk: nothing read
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.stream_read(torch.from_numpy(data)[::2])


def test_silu_mul(kernels):
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(5, 2 * 203, generator=gen) * 6
    expected = F.silu(gate_up[:, :203]) * gate_up[:, 203:]
    assert torch.allclose(kernels.silu_mul(gate_up), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,intermediate", [(3, 203), (70, 256)])  # a tail of 3 after 8-wide steps; none
def test_silu_mul_bf16_is_silu_mul_rounded(kernels, rows, intermediate):
    """bfloat16 in and out: bit for bit what widening, the float32 op and torch's rounding give,
    infinities and values that round up into the next exponent included; a NaN stays a NaN."""
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * intermediate, generator=gen) * 6).bfloat16()
    gate_up[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    gate_up[1, intermediate : intermediate + 2] = torch.tensor([float("inf"), 3.3895e38])
    got = kernels.silu_mul_bf16(gate_up)
    want = kernels.silu_mul(gate_up.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, intermediate)
    nan = want.isnan()  # a NaN's sign and payload are the converter's choice (torch's differs by CPU)
    assert torch.equal(got.isnan(), nan) and nan.any()
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.silu_mul_bf16(gate_up.float())


def _paged_case(gen, seq_lens, num_heads, num_kv_heads, head_dim, block_size, num_blocks=64):
    """A cache with random contents and scattered, shuffled block tables (a strided view, as the
    runner's reused buffers are)."""
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // block_size) for n in seq_lens)
    tables = torch.zeros(len(seq_lens), width + 4, dtype=torch.int64)[:, : width + 1]  # padded with 0
    for i, n in enumerate(seq_lens):
        for j in range(-(-n // block_size)):
            tables[i, j] = order.pop()
    q = torch.randn(len(seq_lens), num_heads + 2 * num_kv_heads, head_dim, generator=gen)[:, :num_heads]
    return q, cache, tables


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 20])
def test_paged_decode_attention_matches_the_eager_backend(kernels, window, heads, head_dim):
    num_heads, num_kv_heads = heads
    block_size = 4
    gen = torch.Generator().manual_seed(num_heads * 100 + head_dim)
    seq_lens = [1, 4, 9, 33, 17]
    q, cache, tables = _paged_case(gen, seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    got = kernels.paged_decode_attention(q, cache, tables, torch.tensor(seq_lens), scale, window or 0)

    eager = EagerBackend(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale,
                         block_size=block_size, sliding_window=window)
    # The eager backend writes the step's keys and values first: hand it the ones already there.
    last = [n - 1 for n in seq_lens]
    slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size for i, p in enumerate(last)])
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(len(seq_lens) + 1), seq_lens=torch.tensor(seq_lens),
        context_lens=torch.tensor(last), block_tables=tables, slot_mapping=slots,
        query_lens_list=[1] * len(seq_lens), seq_lens_list=seq_lens, max_query_len=1, max_seq_len=max(seq_lens),
    )
    expected = eager.forward(q.contiguous(), flat[0][slots].clone(), flat[1][slots].clone(), cache.clone(), meta)
    assert torch.allclose(got, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("window", [None, 50])
def test_paged_decode_attention_splits_one_long_sequence_over_runs(kernels, window):
    # One sequence with one kv head is a single work item: the kernel splits its keys into runs
    # (several per thread) and merges their rescaled sums; the result must not depend on that.
    gen = torch.Generator().manual_seed(7)
    seq_lens = [200]
    q, cache, tables = _paged_case(gen, seq_lens, 4, 1, 32, 16, num_blocks=32)
    got = kernels.paged_decode_attention(q, cache, tables, torch.tensor(seq_lens), 32**-0.5, window or 0)
    keys = torch.cat([cache[0, int(b)] for b in tables[0, :13]])[:200, 0]  # [200, D]
    values = torch.cat([cache[1, int(b)] for b in tables[0, :13]])[:200, 0]
    if window:
        keys, values = keys[-window:], values[-window:]
    weights = torch.softmax(q[0].double() @ keys.double().T * 32**-0.5, dim=-1)
    assert torch.allclose(got[0].double(), weights @ values.double(), atol=2e-6)


@pytest.mark.parametrize("window", [None, 70])
@pytest.mark.parametrize("int8", [False, True])
def test_paged_decode_attention_rows_of_one_sequence_equal_each_row_alone(kernels, window, int8):
    """A speculative step's rows (one block table, keys seen growing by one) share work entries:
    each row must still be exactly its own decode, whatever rows beside it, across run borders."""
    gen = torch.Generator().manual_seed(11)
    q_all, cache, tables = _paged_case(gen, [140, 60], 9, 3, 64, 16, num_blocks=32)
    rows = 9
    lens = [120 + i for i in range(rows)] + [60]  # rows of sequence 0 cross the run border at 128
    table = torch.cat([tables[:1].expand(rows, -1), tables[1:]]).contiguous()
    q = torch.randn(rows + 1, 9, 64, generator=gen)
    args = (torch.tensor(lens), 0.125, window or 0)
    if int8:
        data = (cache * 20).round().clamp(-127, 127).to(torch.int8)
        scales = torch.rand(cache.shape[:4], generator=gen).half() + 0.01
        run = lambda *a: kernels.paged_decode_attention_int8(a[0], data, scales, *a[1:])  # noqa: E731
    else:
        run = lambda *a: kernels.paged_decode_attention(a[0], cache, *a[1:])  # noqa: E731
    for order in (lens, lens[rows - 1 :: -1] + lens[rows:]):  # rows sharing a table, any lengths
        together = run(q, table, torch.tensor(order), *args[1:])
        for i in range(rows + 1):
            alone = run(q[i : i + 1].clone(), table[i : i + 1].clone(), torch.tensor([order[i]]), *args[1:])
            assert torch.equal(together[i], alone[0]), i


def test_paged_decode_attention_rejects_a_table_that_points_outside_the_cache(kernels):
    gen = torch.Generator().manual_seed(0)
    q, cache, tables = _paged_case(gen, [5], 2, 2, 8, 4, num_blocks=8)
    tables[0, 1] = 8
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.paged_decode_attention(q, cache, tables, torch.tensor([5]), 1.0, 0)
    with pytest.raises(RuntimeError, match="block table"):
        kernels.paged_decode_attention(q, cache, tables, torch.tensor([100]), 1.0, 0)


def test_write_kv_stores_strided_keys_and_values_at_their_slots(kernels):
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 6, 4, 3, 8, generator=gen)
    qkv = torch.randn(5, (4 + 2 * 3) * 8, generator=gen)  # k and v: views into a fused projection
    k, v = qkv[:, 32:56].view(5, 3, 8), qkv[:, 56:].view(5, 3, 8)
    slots = torch.tensor([0, 5, 23, 9, 10])
    expected = cache.clone()
    expected.view(2, 24, 3, 8)[0].index_copy_(0, slots, k)
    expected.view(2, 24, 3, 8)[1].index_copy_(0, slots, v)
    kernels.write_kv_(cache, k, v, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.write_kv_(cache, k, v, torch.tensor([0, 1, 2, 3, 24]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_kv_rounds_into_a_16_bit_cache_as_pytorch_does(kernels, dtype):
    gen = torch.Generator().manual_seed(5)
    cache = torch.zeros(2, 6, 4, 3, 8, dtype=dtype)
    qkv = torch.randn(5, (4 + 2 * 3) * 8, generator=gen) * 3
    qkv[0, 40] = float("nan")
    qkv[1, 41] = 1e6  # past float16's range: inf, as `.to(float16)` gives
    qkv[2, 42] = 1.00390625  # halfway between two bfloat16 values: to the even one
    k, v = qkv[:, 32:56].view(5, 3, 8), qkv[:, 56:].view(5, 3, 8)
    slots = torch.tensor([0, 5, 23, 9, 10])
    expected = cache.clone()
    expected.view(2, 24, 3, 8)[0].index_copy_(0, slots, k.to(dtype))
    expected.view(2, 24, 3, 8)[1].index_copy_(0, slots, v.to(dtype))
    kernels.write_kv_(cache, k, v, slots)
    nan = expected.isnan()
    assert nan.sum() == 1 and torch.equal(cache.isnan(), nan)  # a NaN stays one (its bits are not defined)
    assert torch.equal(cache.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])  # the rest bit for bit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("head_dim", [64, 20])
def test_paged_decode_attention_on_a_16_bit_cache_is_the_float32_one_of_its_values(kernels, dtype, window, head_dim):
    # The kernel widens each 16-bit key and value exactly: its result is the float32 kernel's on
    # the widened cache, up to the order of float32 sums (16 lanes or 8).
    gen = torch.Generator().manual_seed(head_dim)
    seq_lens = [1, 9, 200, 33]
    q, cache, tables = _paged_case(gen, seq_lens, 9, 3, head_dim, 16, num_blocks=64)
    low = cache.to(dtype)
    args = (tables, torch.tensor(seq_lens), head_dim**-0.5, window or 0)
    got = kernels.paged_decode_attention(q, low, *args)
    want = kernels.paged_decode_attention(q, low.float(), *args)
    assert torch.allclose(got, want, rtol=1e-5, atol=2e-6)


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def test_kernels_share_pytorchs_thread_team(kernels):
    # A second OpenMP runtime would bring its own team of threads, which fight PyTorch's for the
    # cores (see threads/compute_thread.py): the kernels must start no thread PyTorch's ops did not.
    x = torch.randn(4, 4096)
    torch.mm(torch.randn(256, 256), torch.randn(256, 256))
    x.sum()
    before = _thread_count()
    for _ in range(3):
        kernels.linear_bf16(x, torch.randn(4096, 4096).bfloat16(), None)
        kernels.rms_norm(torch.randn(64, 4096), torch.randn(4096), 1e-5)
    assert _thread_count() == before


def test_configure_modes(kernels):
    assert cpu.configure("off") is None
    assert cpu.configure("auto") is kernels
    with pytest.raises(ValueError, match="auto, on, off"):
        cpu.configure("sometimes")


def test_configure_falls_back_where_unavailable(monkeypatch):
    monkeypatch.setattr(cpu, "_built", None)
    monkeypatch.setattr(cpu, "_build_error", None)
    monkeypatch.setattr(cpu, "cpu_has_avx2_fma", lambda: False)
    assert cpu.configure("auto") is None
    with pytest.raises(cpu.KernelUnavailableError, match="AVX2"):
        cpu.configure("on")


def test_kernel_source_ships_with_the_package():
    assert cpu.SOURCE.exists() and cpu.SOURCE.suffix == ".cpp"
    assert Path(cpu.__file__).parent == cpu.SOURCE.parent
    included = set(re.findall(r'#include "([^"]+)"', "".join(h.read_text() for h in [cpu.SOURCE, *cpu.HEADERS])))
    assert included and included <= {h.name for h in cpu.HEADERS}  # every header the build needs is listed


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_process(kernels):
    """PyTorch's build lock is a file: a first `cadenza serve` stopped mid-build left it, and every
    later process waited on it forever (kernels/cpu/loader.py, _build_lock)."""
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    leftover = Path(_get_build_directory(cpu.extension_name(cpu.isa()), verbose=False)) / "lock"
    leftover.touch()
    try:
        done = subprocess.run([sys.executable, "-c", "from cadenza.kernels.cpu import loader; print(loader.configure('on').packed_path())"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == kernels.packed_path()
        assert "Removing a build lock left by a build that died" in done.stdout + done.stderr
        assert not leftover.exists()
    finally:
        leftover.unlink(missing_ok=True)
