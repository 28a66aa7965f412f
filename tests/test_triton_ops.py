"""The Triton kernels (kernels/triton/) against their torch references, natively where CUDA is present
and under Triton's interpreter on the CPU elsewhere.

Attention is compared with the reference run in float64 on the same cache contents, so the
tolerance only has to cover the kernel's own rounding; the cache writes must match bit for bit.
Unwritten cache slots hold NaN, so any read past a sequence's end shows up in the result.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import pytest
import torch

from cadenza.attention_backends.base import causal_mask
from cadenza.kernels.kv_layout import quantize_int8
from cadenza.kernels.triton import reference

triton = pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def _load_kernels(name: str):
    """Import a kernel module; on the CPU, with its kernels defined under Triton's interpreter.

    `@triton.jit` picks interpreter or compiler when it runs (knobs.runtime.interpret, which reads
    TRITON_INTERPRET), so the knob is on while the module executes, and the module is executed
    again if an earlier test imported it without. The knob is restored afterwards: the kernels keep
    their mode, and the rest of the session is left as it was."""
    with triton.knobs.runtime.scope():
        if not ON_GPU:
            triton.knobs.runtime.interpret = True
        module = importlib.import_module(f"cadenza.kernels.triton.{name}")
        compiled = any(isinstance(value, triton.runtime.JITFunction) for value in vars(module).values())
        if compiled and not ON_GPU:
            module = importlib.reload(module)
    return module


kv_cache_write = _load_kernels("kv_cache_write")
paged_attention = _load_kernels("paged_attention")
layer_ops = _load_kernels("layer_ops")
sampling = _load_kernels("sampling")

# The kernels' error against a float64 reference given the same cache contents (used as atol and
# rtol both), by the coarsest float type the kernel rounds through (the output's, the dot operands'):
# float32 accumulates in float32 (about 1e-7 relative, over a few hundred keys: 6e-7 seen); float16
# rounds p and the output to 11 bits (5e-4 relative: 1e-3 seen at outputs near 3); bfloat16 to 8
# bits (4e-3 relative; the interpreter truncates its output instead, one ulp: 1.5e-2 seen near 3).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
NUM_KV_HEADS = 2


def coarsest(*dtypes: torch.dtype) -> torch.dtype:
    return max((d for d in dtypes if d.is_floating_point), key=lambda d: TOLERANCE[d])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.cpu().double(), expected.cpu(), atol=tol, rtol=tol)


def bits(x: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bits, so NaN compares equal to itself."""
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


@dataclass
class PagedCache:
    """One layer's cache holding `seq_lens` tokens over shuffled, non-contiguous blocks (a few never
    used). The block tables are padded with block 0 and one extra column, as the engine pads them.
    Written slots are random; every other slot is NaN (for int8: its scale is NaN)."""

    seq_lens: list[int]
    tables: torch.Tensor  # [B, max_blocks]
    cache: torch.Tensor  # [2, num_blocks, block_size, NUM_KV_HEADS, head_dim]
    scales: torch.Tensor | None  # [2, num_blocks, block_size, NUM_KV_HEADS] for int8

    @classmethod
    def make(cls, seq_lens, block_size, head_dim, dtype, generator, index_dtype=torch.int64) -> PagedCache:
        needed = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = sum(needed) + 3
        order = torch.randperm(num_blocks, generator=generator).tolist()
        tables = torch.zeros(len(seq_lens), max(needed) + 1, dtype=index_dtype)
        for i, count in enumerate(needed):
            tables[i, :count] = torch.tensor(order[:count])
            order = order[count:]
        slots = written_slots(seq_lens, tables, block_size)
        shape = (2, num_blocks * block_size, NUM_KV_HEADS, head_dim)
        scales = None
        if dtype == torch.int8:
            cache = torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator)
            scales = torch.full(shape[:3], math.nan, dtype=torch.float16)
            scales[:, slots] = (0.005 + 0.02 * torch.rand(2, len(slots), NUM_KV_HEADS, generator=generator)).half()
            scales = scales.view(2, num_blocks, block_size, NUM_KV_HEADS)
        else:
            cache = torch.full(shape, math.nan, dtype=dtype)
            cache[:, slots] = torch.randn(2, len(slots), NUM_KV_HEADS, head_dim, generator=generator).to(dtype)
        return cls(seq_lens, tables, cache.view(2, num_blocks, block_size, NUM_KV_HEADS, head_dim), scales)

    def kernel_inputs(self) -> tuple:
        """(key_cache, value_cache, k_scales, v_scales) as the kernels take them, on DEVICE."""
        cache = self.cache.to(DEVICE)
        if self.scales is None:
            return cache[0], cache[1], None, None
        scales = self.scales.to(DEVICE)
        return cache[0], cache[1], scales[0], scales[1]

    def oracle_inputs(self) -> tuple:
        """The same contents for the float64 reference."""
        if self.scales is None:
            return self.cache[0].double(), self.cache[1].double(), None, None
        return self.cache[0], self.cache[1], self.scales[0], self.scales[1]


def written_slots(seq_lens: list[int], tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """The flat slots of every token of every sequence."""
    return torch.tensor(
        [int(tables[i, t // block_size]) * block_size + t % block_size for i, n in enumerate(seq_lens) for t in range(n)],
        dtype=torch.int64,
    )


# --- cache writes ---------------------------------------------------------------------------------


def write_inputs(src_dtype, head_dim, num_tokens, generator):
    """k and v [T, NUM_KV_HEADS, head_dim] as strided views of one fused projection, as a model
    slices them, with rows of every magnitude (float16 subnormals to 4e4)."""
    fused = torch.randn(num_tokens, 3 * NUM_KV_HEADS, head_dim, generator=generator)
    fused *= torch.logspace(-4, 4, num_tokens).view(-1, 1, 1)
    fused = fused.to(src_dtype).to(DEVICE)
    return fused[:, :NUM_KV_HEADS], fused[:, NUM_KV_HEADS : 2 * NUM_KV_HEADS]


@pytest.mark.parametrize(
    "src_dtype, cache_dtype, block_size, slot_dtype",
    [
        (torch.float32, torch.float32, 16, torch.int64),
        (torch.float32, torch.bfloat16, 1, torch.int32),
        (torch.float32, torch.float16, 32, torch.int64),
        (torch.bfloat16, torch.bfloat16, 16, torch.int32),
        (torch.float16, torch.bfloat16, 16, torch.int64),
        (torch.bfloat16, torch.float16, 32, torch.int64),
    ],
)
def test_write_kv_cache_stores_what_to_gives(src_dtype, cache_dtype, block_size, slot_dtype):
    generator = torch.Generator().manual_seed(1)
    head_dim, num_blocks = 80, 3 + 8 // block_size  # room for slot 7 at any block size
    slot_mapping = torch.tensor([5, -1, 0, num_blocks * block_size - 1, 2, -1, 7], dtype=slot_dtype)
    k, v = write_inputs(src_dtype, head_dim, len(slot_mapping), generator)
    before = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=generator).to(cache_dtype)
    expected = before.clone().view(2, -1, NUM_KV_HEADS, head_dim)
    valid = slot_mapping >= 0
    expected[0, slot_mapping[valid].long()] = k.cpu()[valid].to(cache_dtype)
    expected[1, slot_mapping[valid].long()] = v.cpu()[valid].to(cache_dtype)

    for write in (kv_cache_write.write_kv_cache, reference.write_kv_cache):
        cache = before.clone().to(DEVICE)
        write(k, v, cache, slot_mapping.to(DEVICE))
        # The whole cache: padding rows must have left every other slot alone.
        assert torch.equal(bits(cache.cpu().view_as(expected)), bits(expected)), write.__module__


def int8_rows(src_dtype, head_dim, num_tokens, generator):
    """k rows made to hit quantize_int8's edges: an all-zero row, exact .5 ties (absmax 127 makes
    the scale 1), a scale past float16's range, one in its subnormals; then random rows."""
    k = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=generator)
    k[0] = 0.0
    k[1, :, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 126.5, 1.5, -126.5])
    k[1, :, 8:] = 0.25
    k[2] *= 1e7
    k[3] *= 1e-6
    return k.to(src_dtype).to(DEVICE)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_cache_int8_matches_quantize_int8_bit_for_bit(src_dtype):
    generator = torch.Generator().manual_seed(2)
    head_dim, block_size, num_blocks = 64, 16, 3
    slot_mapping = torch.tensor([17, 3, -1, 40, 0, 31, -1, 9])
    k = int8_rows(src_dtype, head_dim, len(slot_mapping), generator)
    v = torch.randn(k.shape, generator=generator).to(src_dtype).to(DEVICE)
    shape = (2, num_blocks, block_size, NUM_KV_HEADS, head_dim)
    data = torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator)
    scales = torch.rand(shape[:-1], generator=generator).half()
    expected_data = data.clone().view(2, -1, NUM_KV_HEADS, head_dim)
    expected_scales = scales.clone().view(2, -1, NUM_KV_HEADS)
    valid = slot_mapping >= 0
    for i, x in enumerate((k, v)):
        expected_data[i, slot_mapping[valid]], expected_scales[i, slot_mapping[valid]] = quantize_int8(x.cpu()[valid])

    for write in (kv_cache_write.write_kv_cache_int8, reference.write_kv_cache_int8):
        got_data, got_scales = data.clone().to(DEVICE), scales.clone().to(DEVICE)
        write(k, v, got_data, got_scales, slot_mapping.to(DEVICE))
        assert torch.equal(got_data.cpu().view_as(expected_data), expected_data), write.__module__
        assert torch.equal(bits(got_scales.cpu().view_as(expected_scales)), bits(expected_scales)), write.__module__


def test_writes_of_only_padding_rows_change_nothing():
    cache = torch.randn(2, 2, 16, NUM_KV_HEADS, 64, device=DEVICE)
    data = torch.zeros(cache.shape, dtype=torch.int8, device=DEVICE)
    scales = torch.ones(cache.shape[:-1], dtype=torch.float16, device=DEVICE)
    k = torch.randn(3, NUM_KV_HEADS, 64, device=DEVICE)
    slot_mapping = torch.full((3,), -1, device=DEVICE)
    for write in (kv_cache_write.write_kv_cache, reference.write_kv_cache):
        before = cache.clone()
        write(k, k, cache, slot_mapping)
        assert torch.equal(cache, before)
    for write in (kv_cache_write.write_kv_cache_int8, reference.write_kv_cache_int8):
        write(k, k, data, scales, slot_mapping)
        assert not data.any() and bool((scales == 1).all())


# --- attention ------------------------------------------------------------------------------------

# (cache dtype, q dtype, block size, GQA group, head_dim, sliding window, num_splits, index dtype):
# each dtype, block size, group and head_dim at least once, not their cartesian product.
DECODE_CASES = [
    (torch.float32, torch.float32, 16, 1, 64, 0, 1, torch.int64),
    (torch.float32, torch.float32, 1, 3, 80, 0, 4, torch.int32),
    (torch.bfloat16, torch.bfloat16, 16, 4, 128, 0, 8, torch.int32),
    (torch.float16, torch.float16, 32, 3, 64, 24, 3, torch.int64),
    (torch.bfloat16, torch.float32, 32, 1, 80, 10, 5, torch.int64),
    (torch.int8, torch.bfloat16, 16, 4, 64, 0, 2, torch.int32),
    (torch.int8, torch.float32, 1, 1, 80, 12, 1, torch.int64),
    (torch.float16, torch.float16, 256, 8, 256, 0, 2, torch.int64),
]


@pytest.mark.parametrize("cache_dtype, q_dtype, block_size, group, head_dim, window, num_splits, index_dtype", DECODE_CASES)
def test_paged_decode_attention_matches_reference(
    cache_dtype, q_dtype, block_size, group, head_dim, window, num_splits, index_dtype
):
    generator = torch.Generator().manual_seed(3)
    # A padding row (seq_len 0), a first token, a short sequence, and one across many blocks; with
    # several splits, the short ones leave some splits empty.
    seq_lens = [0, 1, 23, 70 if block_size == 1 else 150]
    paged = PagedCache.make(seq_lens, block_size, head_dim, cache_dtype, generator, index_dtype)
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * group, head_dim, generator=generator).to(q_dtype)
    lens = torch.tensor(seq_lens, dtype=index_dtype)
    scale = head_dim**-0.5

    key_cache, value_cache, k_scales, v_scales = paged.kernel_inputs()
    got = paged_attention.paged_decode_attention(
        q.to(DEVICE), key_cache, value_cache, paged.tables.to(DEVICE), lens.to(DEVICE), scale, window,
        k_scales, v_scales, num_splits=num_splits,
    )
    key_cache, value_cache, k_scales, v_scales = paged.oracle_inputs()
    expected = reference.paged_decode_attention(
        q.double(), key_cache, value_cache, paged.tables, lens, scale, window, k_scales, v_scales
    )
    assert got.dtype == q_dtype and got.shape == q.shape
    assert_close(got, expected, coarsest(q_dtype, cache_dtype))
    assert not got[0].any()  # seq_len 0: zeros


def test_paged_decode_attention_writes_into_out():
    """`out` may be a strided view (rows of a larger buffer); with splits, the combine writes it."""
    generator = torch.Generator().manual_seed(4)
    paged = PagedCache.make([9, 40], 16, 64, torch.float32, generator)
    q = torch.randn(2, NUM_KV_HEADS * 2, 64, generator=generator)
    lens = torch.tensor(paged.seq_lens)
    key_cache, value_cache, _, _ = paged.oracle_inputs()
    expected = reference.paged_decode_attention(q.double(), key_cache, value_cache, paged.tables, lens, 0.125)
    key_cache, value_cache, _, _ = paged.kernel_inputs()
    for num_splits in (1, 2):
        buffer = torch.zeros(2, NUM_KV_HEADS * 2 + 1, 64, device=DEVICE)
        out = buffer[:, 1:]
        result = paged_attention.paged_decode_attention(
            q.to(DEVICE), key_cache, value_cache, paged.tables.to(DEVICE), lens.to(DEVICE), 0.125,
            num_splits=num_splits, out=out,
        )
        assert result.data_ptr() == out.data_ptr() and not buffer[:, 0].any()
        assert_close(out, expected, torch.float32)


def stale_column_major(tables: torch.Tensor, seq_lens: list[int], block_size: int) -> torch.Tensor:
    """`tables` as a CUDA-graph step holds them: column-major, two columns wider, and every entry
    past a row's last block an index far outside the cache (any read of one would fault or show)."""
    rows, width = tables.shape
    held = torch.full((width + 2, rows), 2**40, dtype=tables.dtype).t()
    for row, length in enumerate(seq_lens):
        used = -(-length // block_size)
        held[row, :used] = tables[row, :used]
    return held


def test_attention_reads_no_table_entry_past_a_rows_blocks():
    """A padded decode's block table is column-major and stale past each row's blocks
    (runner/step_inputs.py); the kernels must give what a clean row-major table gives."""
    generator = torch.Generator().manual_seed(5)
    paged = PagedCache.make([9, 40, 17], 16, 64, torch.bfloat16, generator)
    q = torch.randn(3, NUM_KV_HEADS * 2, 64, generator=generator).to(torch.bfloat16)
    lens = torch.tensor(paged.seq_lens)
    key_cache, value_cache, _, _ = paged.kernel_inputs()
    stale = stale_column_major(paged.tables, paged.seq_lens, 16)
    assert stale.stride(0) == 1
    for num_splits in (1, 4):
        args = (q.to(DEVICE), key_cache, value_cache)
        clean = paged_attention.paged_decode_attention(*args, paged.tables.to(DEVICE), lens.to(DEVICE), 0.125, num_splits=num_splits)
        held = paged_attention.paged_decode_attention(*args, stale.to(DEVICE), lens.to(DEVICE), 0.125, num_splits=num_splits)
        assert torch.equal(held, clean)
    starts = torch.tensor([0, 1, 2, 3])  # one decode row each
    clean = paged_attention.paged_prefill_attention(q.to(DEVICE), key_cache, value_cache, paged.tables.to(DEVICE),
                                                    starts.to(DEVICE), lens.to(DEVICE), 1, 0.125)
    held = paged_attention.paged_prefill_attention(q.to(DEVICE), key_cache, value_cache, stale.to(DEVICE),
                                                   starts.to(DEVICE), lens.to(DEVICE), 1, 0.125)
    assert torch.equal(held, clean)


# (cache dtype, q dtype, block size, GQA group, head_dim, sliding window, index dtype)
PREFILL_CASES = [
    (torch.float32, torch.float32, 16, 1, 64, 0, torch.int64),
    (torch.bfloat16, torch.bfloat16, 1, 3, 80, 0, torch.int32),
    (torch.float16, torch.float16, 32, 4, 128, 17, torch.int64),
    (torch.int8, torch.float16, 16, 3, 80, 0, torch.int32),
    (torch.int8, torch.float32, 32, 1, 64, 9, torch.int64),
    (torch.bfloat16, torch.float32, 256, 8, 256, 5, torch.int32),
]


@pytest.mark.parametrize("cache_dtype, q_dtype, block_size, group, head_dim, window, index_dtype", PREFILL_CASES)
def test_paged_prefill_attention_matches_reference(cache_dtype, q_dtype, block_size, group, head_dim, window, index_dtype):
    generator = torch.Generator().manual_seed(5)
    # (tokens cached before, new tokens): a fresh prompt, an extend over a cached prefix, two
    # decodes, and a sequence with no rows this step.
    steps = [(0, 37), (45, 13), (29, 1), (0, 1), (5, 0)]
    query_lens = [new for _, new in steps]
    paged = PagedCache.make([cached + new for cached, new in steps], block_size, head_dim, cache_dtype, generator, index_dtype)
    num_heads = NUM_KV_HEADS * group
    # q as a model slices it from a fused projection: strided rows.
    q = torch.randn(sum(query_lens), num_heads + 2, head_dim, generator=generator)[:, :num_heads].to(q_dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=index_dtype)
    lens = torch.tensor(paged.seq_lens, dtype=index_dtype)
    scale = head_dim**-0.5

    key_cache, value_cache, k_scales, v_scales = paged.kernel_inputs()
    got = paged_attention.paged_prefill_attention(
        q.to(DEVICE), key_cache, value_cache, paged.tables.to(DEVICE), query_start_loc.to(DEVICE), lens.to(DEVICE),
        max(query_lens), scale, window, k_scales, v_scales,
    )
    key_cache, value_cache, k_scales, v_scales = paged.oracle_inputs()
    expected = reference.paged_prefill_attention(
        q.double(), key_cache, value_cache, paged.tables, query_start_loc, lens, max(query_lens), scale, window,
        k_scales, v_scales,
    )
    assert got.dtype == q_dtype and got.shape == q.shape
    assert_close(got, expected, coarsest(q_dtype, cache_dtype))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_sinks_join_every_softmax_once(num_splits):
    """gpt-oss's sinks: a logit per head in each row's softmax denominator. The kernels (decode with
    the sink counted by one split only, and prefill) agree with the reference, and the reference
    with the plain softmax over the scores plus a sink column (the eager backend's formulation)."""
    generator = torch.Generator().manual_seed(9)
    group, head_dim, scale = 2, 64, 0.125
    paged = PagedCache.make([0, 1, 23, 90], 16, head_dim, torch.float32, generator)
    num_heads = NUM_KV_HEADS * group
    sinks = torch.randn(num_heads, generator=generator) * 2
    lens = torch.tensor(paged.seq_lens)
    q = torch.randn(len(paged.seq_lens), num_heads, head_dim, generator=generator)
    key_cache, value_cache, _, _ = paged.kernel_inputs()
    got = paged_attention.paged_decode_attention(q.to(DEVICE), key_cache, value_cache, paged.tables.to(DEVICE),
                                                 lens.to(DEVICE), scale, num_splits=num_splits, sinks=sinks.to(DEVICE))
    key_cache, value_cache, _, _ = paged.oracle_inputs()
    expected = reference.paged_decode_attention(q.double(), key_cache, value_cache, paged.tables, lens, scale,
                                                sinks=sinks.double())
    assert_close(got, expected, torch.float32)
    assert not got[0].any()  # seq_len 0: zeros, sink or not
    # The reference against the softmax with a sink column, row 3 (90 keys) by hand.
    keys = key_cache[paged.tables[3]].reshape(-1, NUM_KV_HEADS, head_dim)[:90].repeat_interleave(group, 1)
    values = value_cache[paged.tables[3]].reshape(-1, NUM_KV_HEADS, head_dim)[:90].repeat_interleave(group, 1)
    scores = torch.einsum("hd,khd->hk", q[3].double(), keys) * scale
    probs = torch.cat([scores, sinks.double()[:, None]], dim=1).softmax(-1)[:, :-1]
    torch.testing.assert_close(expected[3], torch.einsum("hk,khd->hd", probs, values))
    # Prefill: a fresh prompt and an extend, every row with its head's sink.
    steps = [(0, 37), (45, 13)]
    paged = PagedCache.make([c + n for c, n in steps], 16, head_dim, torch.float32, generator)
    query_lens = [n for _, n in steps]
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    starts = torch.tensor([0, query_lens[0], sum(query_lens)])
    lens = torch.tensor(paged.seq_lens)
    key_cache, value_cache, _, _ = paged.kernel_inputs()
    got = paged_attention.paged_prefill_attention(q.to(DEVICE), key_cache, value_cache, paged.tables.to(DEVICE),
                                                  starts.to(DEVICE), lens.to(DEVICE), max(query_lens), scale, 7,
                                                  sinks=sinks.to(DEVICE))
    key_cache, value_cache, _, _ = paged.oracle_inputs()
    expected = reference.paged_prefill_attention(q.double(), key_cache, value_cache, paged.tables, starts, lens,
                                                 max(query_lens), scale, 7, sinks=sinks.double())
    assert_close(got, expected, torch.float32)


# --- the references themselves --------------------------------------------------------------------


@pytest.mark.parametrize("window", [0, 6])
def test_prefill_reference_matches_a_loop_over_sequences(window):
    """The oracle checked against the plainest reading of the contract: one sequence at a time,
    its keys read slot by slot, masked by attention_backends.base.causal_mask."""
    generator = torch.Generator().manual_seed(6)
    block_size, head_dim, group = 4, 16, 2
    steps = [(0, 9), (7, 5), (12, 1)]
    paged = PagedCache.make([cached + new for cached, new in steps], block_size, head_dim, torch.float64, generator)
    flat = paged.cache.view(2, -1, NUM_KV_HEADS, head_dim)
    q = torch.randn(15, NUM_KV_HEADS * group, head_dim, generator=generator, dtype=torch.float64)
    starts = [0, 9, 14, 15]

    got = reference.paged_prefill_attention(
        q, paged.cache[0], paged.cache[1], paged.tables, torch.tensor(starts), torch.tensor(paged.seq_lens), 9, 0.3, window
    )
    for i, (cached, new) in enumerate(steps):
        seq_len = cached + new
        slots = written_slots([seq_len], paged.tables[i : i + 1], block_size)
        keys, values = (flat[j, slots].repeat_interleave(group, dim=1) for j in (0, 1))  # [seq_len, heads, D]
        allowed = causal_mask(torch.arange(cached, seq_len), torch.arange(seq_len), torch.tensor(seq_len), window or None)
        scores = torch.einsum("qhd,khd->hqk", q[starts[i] : starts[i + 1]], keys) * 0.3
        weights = scores.masked_fill(~allowed, -math.inf).softmax(-1)
        torch.testing.assert_close(got[starts[i] : starts[i + 1]], torch.einsum("hqk,khd->qhd", weights, values))


def test_references_trace_whole_under_torch_compile():
    """The CPU fallback runs inside a `torch.compile(fullgraph=True)` model step: no graph break, no
    data-dependent shape. (aot_eager traces as inductor does, without paying for code generation.)"""
    generator = torch.Generator().manual_seed(7)
    paged = PagedCache.make([5, 0, 20], 4, 16, torch.float32, generator)
    q = torch.randn(3, NUM_KV_HEADS, 16, generator=generator)
    args = (q, paged.cache[0], paged.cache[1], paged.tables, torch.tensor(paged.seq_lens), 0.25, 8)

    decode = torch.compile(reference.paged_decode_attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(decode(*args), reference.paged_decode_attention(*args))

    write = torch.compile(reference.write_kv_cache, fullgraph=True, backend="aot_eager")
    slot_mapping = torch.tensor([3, -1, 0])
    compiled_cache, eager_cache = paged.cache.nan_to_num(), paged.cache.nan_to_num()
    write(q, q, compiled_cache, slot_mapping)
    reference.write_kv_cache(q, q, eager_cache, slot_mapping)
    assert torch.equal(compiled_cache, eager_cache)


# --- CUDA graphs (GPU only) -----------------------------------------------------------------------


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_decode_replays_from_a_cuda_graph_with_new_lengths():
    """Captured once, the write and the split decode follow new slots, lengths and block tables."""
    generator = torch.Generator().manual_seed(8)
    block_size, head_dim, max_blocks = 16, 64, 8
    num_blocks = 2 * max_blocks
    cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=generator).to(DEVICE)
    q = torch.zeros(2, NUM_KV_HEADS * 4, head_dim, device=DEVICE)
    k = torch.zeros(2, NUM_KV_HEADS, head_dim, device=DEVICE)
    slot_mapping = torch.full((2,), -1, device=DEVICE)
    tables = torch.zeros(2, max_blocks, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(2, dtype=torch.int32, device=DEVICE)

    def step():
        kv_cache_write.write_kv_cache(k, k, cache, slot_mapping)
        return paged_attention.paged_decode_attention(q, cache[0], cache[1], tables, lens, 0.125, num_splits=4)

    step()  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new_lens in ([5, 0], [128, 77]):
        new_tables = torch.randperm(num_blocks, generator=generator).view(2, max_blocks)
        slots = [int(new_tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
                 for i, n in enumerate(new_lens)]
        q.copy_(torch.randn(q.shape, generator=generator))
        k.copy_(torch.randn(k.shape, generator=generator))
        slot_mapping.copy_(torch.tensor(slots))
        tables.copy_(new_tables)
        lens.copy_(torch.tensor(new_lens))
        graph.replay()
        expected = reference.paged_decode_attention(q.double(), cache[0].double(), cache[1].double(), tables, lens, 0.125)
        assert_close(out, expected, torch.float32)


# --- the layer's elementwise work (layer_ops) ------------------------------------------------------


def _torch_norm(size: int, dtype: torch.dtype, offset: float, generator) -> torch.nn.Module:
    from cadenza.models.llama import RMSNorm

    norm = RMSNorm(size, 1e-5, offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(size, generator=generator))
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_x", [True, False])
def test_add_rms_norm_is_the_residual_add_and_the_norm_of_the_modules(dtype, offset, with_x):
    """The residual written in place equals torch's add bit for bit; the norm is the RMSNorm
    module's up to the order of its sum of squares (and rsqrt's last bits on a GPU)."""
    generator = torch.Generator().manual_seed(11)
    size = 576  # not a power of two: masked columns
    norm = _torch_norm(size, dtype, offset, generator)
    residual = (4 * torch.randn(7, size, generator=generator)).to(dtype)
    x = torch.randn(7, size, generator=generator).to(dtype) if with_x else None
    summed = residual + x if with_x else residual.clone()
    expected = norm(summed)
    got_residual = residual.to(DEVICE)
    got = layer_ops.add_rms_norm_(x.to(DEVICE) if with_x else None, got_residual, norm.weight.to(DEVICE), 1e-5, offset)
    assert torch.equal(got_residual.cpu(), summed)
    assert got.dtype == dtype and got.shape == summed.shape
    assert_close(got, expected.double(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim, dims", [(64, 64), (128, 64)])
def test_rotary_rotates_in_place_as_apply_rotary(dtype, head_dim, dims):
    """Heads rotated in place at each token's position, as kernels/rotary.py's torch rotation
    does (bit for bit where no multiply-add is contracted: on the CPU; on a GPU in float32, to
    rounding); under partial rotary the trailing dimensions are left as they were."""
    from cadenza.kernels.rotary import apply_rotary
    from cadenza.models.config import RopeConfig
    from cadenza.models.rotary import RotaryEmbedding

    generator = torch.Generator().manual_seed(12)
    embedding = RotaryEmbedding(RopeConfig(theta=10000.0), dims, 4096)
    positions = torch.tensor([0, 5, 4095, 17, 17, 1000])
    x = torch.randn(len(positions), 6, head_dim, generator=generator).to(dtype)
    cos, sin = embedding.cos_sin(positions, dtype)
    expected = x.clone()
    expected[..., :dims] = apply_rotary(x[..., :dims], cos, sin)
    got = x.to(DEVICE)
    out = layer_ops.rotary_(got, positions.to(DEVICE), embedding.cos_table.to(DEVICE), embedding.sin_table.to(DEVICE), dims)
    assert out.data_ptr() == got.data_ptr()
    if ON_GPU and dtype == torch.float32:
        assert_close(got, expected.double(), dtype)
    else:
        assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_is_the_mlps_activation(dtype):
    """SiLU(gate) * up as the MLP module computes it from a fused gate_up (gate first), up to the
    last bits of exp."""
    from cadenza.models.llama import MLP

    generator = torch.Generator().manual_seed(13)
    width = 1400  # more than one program's columns, and masked ones
    gate_up = (3 * torch.randn(5, 2 * width, generator=generator)).to(dtype)
    mlp = MLP.__new__(MLP)
    mlp.intermediate, mlp.act = width, "silu"
    expected = MLP.activate(mlp, gate_up)
    got = layer_ops.silu_mul(gate_up.to(DEVICE))
    assert got.shape == (5, width) and got.dtype == dtype
    assert_close(got, expected.double(), dtype)


def test_layer_ops_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="contiguous"):
        layer_ops.add_rms_norm_(None, torch.zeros(4, 8, device=DEVICE).t(), torch.ones(4, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        layer_ops.rotary_(torch.zeros(1, 1, 24, device=DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE),
                          torch.zeros(8, 24, device=DEVICE), torch.zeros(8, 24, device=DEVICE))
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        layer_ops.silu_mul(torch.zeros(2, 7, device=DEVICE))


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "gemma3", "granite", "smollm3", "phi3", "qwen3_moe", "gpt_oss"])
def test_every_family_gives_its_logits_on_the_layer_ops(tiny_model_dir, arch):
    """A model on the layer ops (each residual add fused with the next norm, carried across layers;
    rotary and SiLU x up as kernels) gives the logits of its torch modules: families whose layers
    the fused ops do not cover (Gemma's norms around each block, Granite's residual multiplier)
    and mixtures (their experts add in place) take the modules' path inside the same loop."""
    from cadenza.models.loading import load_model
    from tests.model_forward import prefill_logits

    loaded = load_model(tiny_model_dir(arch), dtype=torch.float32, cpu_kernels="off")
    prompt = [5, 17, 101, 33, 250, 7, 64, 12, 199, 3, 80, 41, 9, 290, 2, 77]
    expected = prefill_logits(loaded, prompt)
    loaded.model.use_layer_ops(layer_ops)
    got = prefill_logits(loaded, prompt)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)



# --- the one-pass sampler (sampling) -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_sampler_is_argmax_where_greedy(dtype):
    """Temperature 0: torch's argmax, the first index of a tie, over a vocabulary of more than one
    block (5,000 > 4,096), masked tokens (-inf) never picked."""
    generator = torch.Generator().manual_seed(21)
    logits = torch.randn(6, 5000, generator=generator).to(dtype)
    logits[1, 4999] = logits[1, 17] = 50.0  # a tie across blocks: the first wins
    logits[2, :4500] = -math.inf
    logits[3] = 1.0  # all equal: index 0
    keys = torch.tensor([sampling.row_key(i, 0) for i in range(6)])
    got = sampling.sample(logits.to(DEVICE), torch.zeros(6, device=DEVICE), keys.to(DEVICE))
    assert torch.equal(got.cpu(), logits.argmax(dim=-1)) and got[1] == 17


def test_one_pass_sampler_draws_from_the_softmax_at_its_temperature():
    """Rows with the same logits and different keys: each token's frequency within 4.5 standard
    deviations of softmax(logits / T); a masked token never drawn."""
    rows, temperature = 800, 0.7
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -math.inf, 1.5])
    keys = torch.tensor([sampling.row_key(12345, i) for i in range(rows)])
    got = sampling.sample(logits.repeat(rows, 1).to(DEVICE), torch.full((rows,), temperature, device=DEVICE), keys.to(DEVICE))
    counts = torch.bincount(got.cpu(), minlength=len(logits)).double()
    p = torch.softmax(logits.double() / temperature, dim=-1)
    sigma = (rows * p * (1 - p)).sqrt()
    assert counts[5] == 0
    assert ((counts - rows * p).abs() <= 4.5 * sigma + 1).all(), (counts / rows, p)


def test_one_pass_sampler_rows_depend_on_their_key_alone():
    """A row's token depends on its key and logits, not on the rows beside it; other keys draw
    other tokens."""
    generator = torch.Generator().manual_seed(22)
    logits = torch.randn(8, 300, generator=generator)
    keys = torch.tensor([sampling.row_key(7, i) for i in range(8)])
    temps = torch.full((8,), 1.0)
    together = sampling.sample(logits.to(DEVICE), temps.to(DEVICE), keys.to(DEVICE)).cpu()
    alone = [int(sampling.sample(logits[i : i + 1].to(DEVICE), temps[:1].to(DEVICE), keys[i : i + 1].to(DEVICE))) for i in range(8)]
    assert together.tolist() == alone
    flat = torch.zeros(64, 300)  # uniform rows: the keys alone choose
    draws = sampling.sample(flat.to(DEVICE), torch.ones(64, device=DEVICE), torch.arange(64).to(DEVICE)).cpu()
    assert len(set(draws.tolist())) > 40


def test_a_mixed_steps_leading_decodes_take_the_decode_kernel(monkeypatch):
    """Two decodes, then an extend over a cached prefix and a fresh prefill: the decode rows go to
    the decode kernel, the rest to the prefill kernel, and the step equals the torch references'."""
    from cadenza.attention_backends.base import AttentionMetadata
    from cadenza.attention_backends.triton_paged import TritonOptions, TritonPagedBackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    generator = torch.Generator().manual_seed(31)
    block_size, heads, head_dim = 4, 8, 32
    query_lens, seq_lens = [1, 1, 5, 6], [9, 20, 12, 6]
    tables = torch.zeros(4, 5, dtype=torch.int64)
    slots, next_block = [], 0
    for i, n in enumerate(seq_lens):
        blocks = -(-n // block_size)
        tables[i, :blocks] = torch.arange(next_block, next_block + blocks)
        next_block += blocks
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(n - query_lens[i], n)]
    tokens = sum(query_lens)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2, 7, 13]), seq_lens=torch.tensor(seq_lens),
        context_lens=torch.tensor([s - q for s, q in zip(seq_lens, query_lens)]), block_tables=tables,
        slot_mapping=torch.tensor(slots), query_lens_list=query_lens, seq_lens_list=seq_lens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
    )  # fmt: skip
    cache = torch.randn(2, next_block, block_size, NUM_KV_HEADS, head_dim, generator=generator)
    q = torch.randn(tokens, heads, head_dim, generator=generator)
    k, v = torch.randn(2, tokens, NUM_KV_HEADS, head_dim, generator=generator)
    written = cache.clone().view(2, -1, NUM_KV_HEADS, head_dim)
    written[:, meta.slot_mapping] = torch.stack([k, v])
    written = written.view(cache.shape).double()
    # The whole step as one prefill over the written cache, in float64: no split in it.
    expected = reference.paged_prefill_attention(q.double(), written[0], written[1], tables, meta.query_start_loc,
                                                 meta.seq_lens, max(query_lens), 0.2)  # fmt: skip
    for implementation in ("triton", "torch"):
        backend = TritonPagedBackend(num_heads=heads, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, scale=0.2,
                                     block_size=block_size,
                                     options=TritonOptions(implementation=implementation))  # fmt: skip
        backend.begin_step(meta)
        assert backend._leading_decodes == 2
        assert_close(backend.forward(q, k, v, cache.clone(), meta), expected, torch.float32)
