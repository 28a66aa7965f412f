"""Attention backends over a paged cache against dense attention computed without any paging."""

import pytest
import torch

from cadenza.attention_backends.base import AttentionMetadata
from cadenza.attention_backends.eager import EagerBackend
from cadenza.attention_backends.torch_sdpa import TorchSDPABackend

HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS = 4, 2, 16, 4, 64


def make_step(context_lens, query_lens, seed=0):
    """A step over shuffled, non-contiguous blocks, with the earlier tokens already cached."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, full_keys, full_values = [], [], []
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM)
    slots = []
    for ctx, q in zip(context_lens, query_lens):
        n_blocks = -(-(ctx + q) // BLOCK)
        table = [order.pop() for _ in range(n_blocks)]
        tables.append(table)
        keys = torch.randn(ctx + q, KV_HEADS, DIM, generator=g)
        values = torch.randn(ctx + q, KV_HEADS, DIM, generator=g)
        full_keys.append(keys)
        full_values.append(values)
        for pos in range(ctx + q):
            slot = (table[pos // BLOCK], pos % BLOCK)
            if pos < ctx:
                cache[0][slot], cache[1][slot] = keys[pos], values[pos]
            else:
                slots.append(slot[0] * BLOCK + slot[1])
    width = max(map(len, tables))
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens),
        context_lens=torch.tensor(context_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots),
        query_lens_list=list(query_lens),
        seq_lens_list=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    total = sum(query_lens)
    q = torch.randn(total, HEADS, DIM, generator=g)
    k = torch.cat([keys[c:] for keys, c in zip(full_keys, context_lens)])
    v = torch.cat([values[c:] for values, c in zip(full_values, context_lens)])
    return q, k, v, cache, meta, full_keys, full_values


def dense_reference(q, meta, full_keys, full_values, window):
    out = []
    starts = meta.query_start_loc.tolist()
    group = HEADS // KV_HEADS
    for i, (keys, values) in enumerate(zip(full_keys, full_values)):
        queries = q[starts[i] : starts[i + 1]]
        seq_len = keys.shape[0]
        for j in range(queries.shape[0]):
            pos = seq_len - queries.shape[0] + j
            lo = 0 if window is None else max(0, pos - window + 1)
            k = keys[lo : pos + 1].repeat_interleave(group, 1)
            v = values[lo : pos + 1].repeat_interleave(group, 1)
            w = torch.einsum("hd,khd->hk", queries[j], k) * DIM**-0.5
            out.append(torch.einsum("hk,khd->hd", w.softmax(-1), v))
    return torch.stack(out)


def _kernels():
    from cadenza.kernels.cpu import loader as cpu
    from cadenza.kernels.cpu.features import cpu_has_avx2_fma

    return cpu.configure("auto") if cpu_has_avx2_fma() else None


@pytest.mark.parametrize("backend_cls,with_kernels", [(TorchSDPABackend, False), (TorchSDPABackend, True), (EagerBackend, False)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    "context_lens,query_lens",
    [
        ([0, 0, 0], [1, 7, 13]),  # prefills, one shorter than a block, one over three blocks
        ([5, 9, 30, 2], [1, 1, 1, 1]),  # decodes only
        ([0, 11, 6, 0], [9, 1, 5, 1]),  # prefill, decode, chunk after a cached prefix, 1-token prompt
        ([40, 3, 0, 17, 8], [1, 1, 12, 1, 6]),  # decodes (one long) beside two chunks: two groups
    ],
)
def test_backend_matches_dense_attention(backend_cls, with_kernels, window, context_lens, query_lens):
    q, k, v, cache, meta, full_keys, full_values = make_step(context_lens, query_lens)
    backend = backend_cls(
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, scale=DIM**-0.5, block_size=BLOCK, sliding_window=window
    )
    if with_kernels:
        kernels = _kernels()
        if kernels is None:
            pytest.skip("the CPU kernels need x86-64 with AVX2 and FMA")
        backend.use_cpu_kernels(kernels)
    backend.begin_step(meta)
    out = backend.forward(q, k, v, cache, meta)
    expected = dense_reference(q, meta, full_keys, full_values, window)
    assert (out - expected).abs().max().item() < 1e-5
    # The new keys and values were written where the slot mapping says.
    flat = cache.view(2, -1, KV_HEADS, DIM)
    assert torch.equal(flat[0][meta.slot_mapping], k)
    assert torch.equal(flat[1][meta.slot_mapping], v)


@pytest.mark.parametrize("with_kernels", [False, True])
def test_chunks_over_a_bf16_cache_attend_in_bf16_where_the_cpu_has_it(with_kernels, monkeypatch):
    """float32 queries over a bfloat16 cache (a GGUF model's): prefill chunks attend in bfloat16
    on CPUs with native bfloat16 (float32 elsewhere), within bfloat16's rounding of the dense
    result over the cached (rounded) keys and values; decodes stay float32."""
    import torch.nn.functional as F

    from cadenza.kernels.cpu.features import cpu_has_native_bf16

    q, k, v, cache, meta, full_keys, full_values = make_step([0, 11, 6], [20, 24, 1])
    cache = cache.bfloat16()
    rounded = lambda xs: [x.bfloat16().float() for x in xs]  # noqa: E731
    backend = TorchSDPABackend(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, scale=DIM**-0.5, block_size=BLOCK)
    if with_kernels:
        kernels = _kernels()
        if kernels is None:
            pytest.skip("the CPU kernels need x86-64 with AVX2 and FMA")
        backend.use_cpu_kernels(kernels)
    dtypes = []
    sdpa = F.scaled_dot_product_attention

    def recording(query, *args, **kwargs):
        dtypes.append((query.shape[2], query.dtype))
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    backend.begin_step(meta)
    out = backend.forward(q, k, v, cache, meta)
    expected = dense_reference(q, meta, rounded(full_keys), rounded(full_values), None)
    assert out.dtype == torch.float32 and (out - expected).abs().max().item() < 3e-2
    chunk_dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert (24, chunk_dtype) in dtypes and all(dtype == torch.float32 for rows, dtype in dtypes if rows == 1)
