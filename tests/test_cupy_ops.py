"""kernels/cuda: the torch fallbacks (on CPU), the loader's kernel-or-torch decision (with a fake cupy),
and, where CUDA and a matching cupy are present, the NVRTC-compiled kernels against the fallbacks."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import re
from types import SimpleNamespace

import pytest
import torch

from cadenza.kernels.cuda import loader, rotary_kv, top_k_top_p
from cadenza.kernels.cuda.rotary_kv import rotary_and_write_kv, rotary_and_write_kv_int8
from cadenza.kernels.kv_layout import KV_SCALE_DTYPE, Int8KVCache, quantize_int8, write_kv
from cadenza.kernels.rotary import apply_rotary
from cadenza.models.config import RopeConfig
from cadenza.models.rotary import RotaryEmbedding
from cadenza.samplers.base import SamplingBatch, SamplingContext
from cadenza.samplers.logits_processors import TopKTopPProcessor
from cadenza.sampling_params import SamplingParams

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CPU = torch.device("cpu")
CUDA0 = torch.device("cuda", 0)


def _gpu_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    _, why = loader.cupy_or_reason()
    return f"needs a cupy matching torch's CUDA: {why}" if why else None


_MISSING = _gpu_missing()
requires_kernels = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


# ---- inputs and references ---------------------------------------------------------------------


def make_rotary_inputs(tokens=7, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                       num_blocks=6, block_size=16, cache_dtype=torch.float32, device=CPU, seed=0):
    """q, k, v as views of one fused qkv (strided, as a model makes them), a cache of random bytes,
    and slots with every third row padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    embedding = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 2048).to(device)
    qkv = (torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=g) * 3).to(dtype).to(device)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    shape = (tokens, -1, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[::3] = -1
    cache_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if cache_dtype == torch.int8:
        cache = Int8KVCache(
            torch.randint(-127, 128, cache_shape, dtype=torch.int8, generator=g).to(device),
            torch.rand(cache_shape[:-1], generator=g).to(KV_SCALE_DTYPE).to(device),
        )
    else:
        cache = torch.randn(cache_shape, generator=g).to(cache_dtype).to(device)
    return SimpleNamespace(
        qkv=qkv, q=q.view(shape), k=k.view(shape), v=v.view(shape),
        positions=torch.randint(0, 2048, (tokens,), generator=g).to(device),
        embedding=embedding, cache=cache, slots=slots.to(device),
    )


def reference_rotary_kv(x: SimpleNamespace):
    """(rotated q, rotated k, cache) as apply_rotary and write_kv make them, on copies."""
    cos, sin = x.embedding.cos_sin(x.positions, x.q.dtype)
    q, k = apply_rotary(x.q, cos, sin), apply_rotary(x.k, cos, sin)
    cache = Int8KVCache(x.cache.data.clone(), x.cache.scales.clone()) if isinstance(x.cache, Int8KVCache) else x.cache.clone()
    keep = x.slots >= 0
    write_kv(k[keep], x.v[keep], cache, x.slots[keep])
    return q, k, cache


def run_rotary_kv(x: SimpleNamespace) -> None:
    args = (x.q, x.k, x.v, x.positions, x.embedding.cos_table, x.embedding.sin_table)
    if isinstance(x.cache, Int8KVCache):
        rotary_and_write_kv_int8(*args, x.cache.data, x.cache.scales, x.slots)
    else:
        rotary_and_write_kv(*args, x.cache, x.slots)


def assert_rotary_kv_equal(x: SimpleNamespace, expected) -> None:
    q, k, cache = expected
    assert torch.equal(x.q, q) and torch.equal(x.k, k)
    if isinstance(cache, Int8KVCache):
        assert torch.equal(x.cache.data, cache.data) and torch.equal(x.cache.scales, cache.scales)
    else:
        assert torch.equal(x.cache, cache)


def make_batch(params: list[SamplingParams]) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params=params, prompt_token_ids=[[]] * n, output_token_ids=[[]] * n, generators=[None] * n)


def make_processor(vocab: int) -> TopKTopPProcessor:
    return TopKTopPProcessor(SamplingContext(vocab_size=vocab, eos_token_ids=(0,), device=CPU))


# ---- the torch fallbacks, on CPU ---------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", DTYPES + [torch.int8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_fallback_is_apply_rotary_then_write_kv(dtype, cache_dtype):
    x = make_rotary_inputs(dtype=dtype, cache_dtype=cache_dtype)
    expected = reference_rotary_kv(x)
    run_rotary_kv(x)
    assert_rotary_kv_equal(x, expected)


@pytest.mark.parametrize("block_size", [1, 16])
def test_rotary_fallback_leaves_the_cache_alone_at_padding_rows(block_size):
    x = make_rotary_inputs(tokens=6, num_blocks=12 if block_size == 1 else 2, block_size=block_size)
    before = x.cache.clone()
    run_rotary_kv(x)
    flat_before, flat_after = before.view(2, -1, *before.shape[3:]), x.cache.view(2, -1, *before.shape[3:])
    written = x.slots[x.slots >= 0]
    untouched = torch.ones(flat_after.shape[1], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat_after[:, untouched], flat_before[:, untouched])
    rows = (x.slots >= 0).nonzero().squeeze(1)
    assert torch.equal(flat_after[0, written], x.k[rows]) and torch.equal(flat_after[1, written], x.v[rows])


def test_rotary_int8_fallback_quantizes_as_quantize_int8():
    x = make_rotary_inputs(cache_dtype=torch.int8, dtype=torch.bfloat16)
    x.v[1] = 0  # an all-zero row: scale 0, values 0
    run_rotary_kv(x)
    data, scales = x.cache.data.view(2, -1, 2, 64), x.cache.scales.view(2, -1, 2)
    rows = (x.slots >= 0).nonzero().squeeze(1)
    for i, tensor in enumerate((x.k, x.v)):
        values, scale = quantize_int8(tensor[rows])
        assert torch.equal(data[i, x.slots[rows]], values) and torch.equal(scales[i, x.slots[rows]], scale)


def test_rotary_refuses_inconsistent_shapes_before_touching_anything():
    x = make_rotary_inputs()
    q_before = x.q.clone()
    table = x.embedding.cos_table
    with pytest.raises(ValueError, match="k and v"):
        rotary_and_write_kv(x.q, x.k[:, :1], x.v, x.positions, table, x.embedding.sin_table, x.cache, x.slots)
    with pytest.raises(ValueError, match="positions"):
        rotary_and_write_kv(x.q, x.k, x.v, x.positions[:2], table, x.embedding.sin_table, x.cache, x.slots)
    with pytest.raises(ValueError, match="cos and sin"):
        rotary_and_write_kv(x.q, x.k, x.v, x.positions, table[:, :8], x.embedding.sin_table, x.cache, x.slots)
    assert torch.equal(x.q, q_before)


TOP_K_TOP_P_SETTINGS = [
    dict(), dict(top_k=1), dict(top_k=40), dict(top_p=0.9), dict(top_k=40, top_p=0.8),
    dict(top_p=0.3), dict(temperature=0, top_k=3), dict(top_k=100_000, top_p=0.99),
]


def test_top_k_top_p_dispatch_on_cpu_is_the_processor(monkeypatch):
    monkeypatch.setattr(loader, "_import_cupy", lambda: pytest.fail("CPU logits must never ask for cupy"))
    vocab = 1000
    logits = torch.randn(len(TOP_K_TOP_P_SETTINGS), vocab) * 4
    logits[0, :30] = logits[0, 30]  # ties
    processor = make_processor(vocab)
    batch = make_batch([SamplingParams(**s) for s in TOP_K_TOP_P_SETTINGS])
    expected = processor.apply(logits.clone(), batch)
    ks, ps = processor._row_params(batch, vocab)
    assert torch.equal(top_k_top_p.top_k_top_p(logits.clone(), ks, ps), expected)
    with pytest.raises(RuntimeError, match="cannot run"):
        top_k_top_p.top_k_top_p_cuda(logits, torch.tensor(ks, dtype=torch.int32), torch.tensor(ps))


# ---- the loader's decision, with a fake cupy -------------------------------------------------------


class RecordingLog:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def info(self, event, **kw):
        self.lines.append(("info", event, kw))

    def warning(self, event, **kw):
        self.lines.append(("warning", event, kw))


def make_fake_cupy(cuda_version: int, compile_error: str | None = None) -> SimpleNamespace:
    """A cupy that reports `cuda_version` (12080 for 12.8) and compiles by recording the source."""
    compiled: list[tuple[str, tuple]] = []

    class RawModule:
        def __init__(self, *, code, options):
            self.code, self.options = code, options

        def get_function(self, name):
            if compile_error:
                raise RuntimeError(compile_error)
            compiled.append((self.code, self.options))
            return f"kernel:{name}"

    class Device:
        def __init__(self, index):
            assert index == 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    runtime = SimpleNamespace(runtimeGetVersion=lambda: cuda_version)
    return SimpleNamespace(cuda=SimpleNamespace(runtime=runtime, Device=Device), RawModule=RawModule, compiled=compiled)


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader with no decision made yet and its log recorded; a CUDA 12.8 torch by default."""
    loader.reset()
    log = RecordingLog()
    monkeypatch.setattr(loader, "log", log)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    yield log
    loader.reset()


def use_fake_cupy(monkeypatch, cupy) -> list[int]:
    imports: list[int] = []

    def fake_import():
        imports.append(1)
        if isinstance(cupy, Exception):
            raise cupy
        return cupy

    monkeypatch.setattr(loader, "_import_cupy", fake_import)
    return imports


def test_cpu_tensors_never_import_cupy(fresh_loader, monkeypatch):
    imports = use_fake_cupy(monkeypatch, make_fake_cupy(12080))
    assert loader.kernels_for(top_k_top_p.SOURCE, (top_k_top_p.KERNEL,), CPU) is None
    assert imports == [] and fresh_loader.lines == []


def test_a_cpu_build_of_torch_falls_back(fresh_loader, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    imports = use_fake_cupy(monkeypatch, make_fake_cupy(12080))
    assert loader.kernels_for(top_k_top_p.SOURCE, (top_k_top_p.KERNEL,), CUDA0) is None
    assert imports == [] and "not a CUDA build" in loader.kernel_error(top_k_top_p.SOURCE)


def test_missing_cupy_falls_back_and_says_which_wheel_once(fresh_loader, monkeypatch):
    imports = use_fake_cupy(monkeypatch, ImportError("No module named 'cupy'"))
    for _ in range(3):
        assert loader.kernels_for(rotary_kv.SOURCE, rotary_kv.KERNELS, CUDA0) is None
    assert len(imports) == 1
    ((level, event, fields),) = fresh_loader.lines
    assert level == "info" and "torch ops" in event and "install cupy-cuda12x" in fields["reason"]


@pytest.mark.parametrize(
    "torch_cuda, cupy_cuda, wheel", [("12.8", 13000, "cupy-cuda12x"), ("13.0", 12080, "cupy-cuda13x")]
)
def test_a_cupy_for_another_cuda_major_falls_back(fresh_loader, monkeypatch, torch_cuda, cupy_cuda, wheel):
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    cupy = make_fake_cupy(cupy_cuda)
    use_fake_cupy(monkeypatch, cupy)
    assert loader.kernels_for(top_k_top_p.SOURCE, (top_k_top_p.KERNEL,), CUDA0) is None
    assert loader.kernels_for(top_k_top_p.SOURCE, (top_k_top_p.KERNEL,), CUDA0) is None
    assert cupy.compiled == []
    ((level, _, fields),) = fresh_loader.lines
    assert level == "warning" and f"CUDA {cupy_cuda // 1000}" in fields["reason"] and wheel in fields["reason"]


def test_a_matching_cupy_compiles_each_source_once(fresh_loader, monkeypatch):
    cupy = make_fake_cupy(12080)
    use_fake_cupy(monkeypatch, cupy)
    for _ in range(2):
        kernels = loader.kernels_for(rotary_kv.SOURCE, rotary_kv.KERNELS, CUDA0)
        assert kernels == {name: f"kernel:{name}" for name in rotary_kv.KERNELS}
    source = importlib.resources.files("cadenza.kernels.cuda").joinpath(rotary_kv.SOURCE).read_text()
    assert {code for code, _ in cupy.compiled} == {source}
    assert len(cupy.compiled) == len(rotary_kv.KERNELS)  # one get_function each, one compile in all
    assert cupy.compiled[0][1] == loader.NVRTC_OPTIONS
    assert [line[1] for line in fresh_loader.lines] == ["cupy kernels ready"]
    assert loader.kernel_error(rotary_kv.SOURCE) is None


def test_a_compile_failure_falls_back_and_is_logged_once(fresh_loader, monkeypatch):
    use_fake_cupy(monkeypatch, make_fake_cupy(12080, compile_error="rotary_kv.cu(42): error: identifier undefined"))
    for _ in range(2):
        assert loader.kernels_for(rotary_kv.SOURCE, rotary_kv.KERNELS, CUDA0) is None
    assert "identifier undefined" in loader.kernel_error(rotary_kv.SOURCE)
    ((level, event, fields),) = fresh_loader.lines
    assert level == "warning" and "compile" in event and fields["source"] == rotary_kv.SOURCE


def test_cupy_cuda_major_falls_back_on_the_wheel_name(monkeypatch):
    def broken():
        raise RuntimeError("no CUDA runtime")

    def version(name):
        if name == "cupy-cuda13x":
            return "13.6.0"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    cupy = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(runtimeGetVersion=broken)))
    assert loader.cupy_cuda_major(cupy) == 13


def test_every_kernel_name_is_defined_in_its_source():
    root = importlib.resources.files("cadenza.kernels.cuda")
    rotary = root.joinpath(rotary_kv.SOURCE).read_text()
    defined = set(re.findall(r"^ROTARY_KV(?:_INT8)?\((\w+),", rotary, flags=re.M))
    assert defined == set(rotary_kv.KERNELS)
    assert f'extern "C" __global__ void {top_k_top_p.KERNEL}(' in root.joinpath(top_k_top_p.SOURCE).read_text()


# ---- the kernels, where CUDA and a matching cupy are present ---------------------------------------


def edge_tokens(logits: torch.Tensor, ks: list[int], ps: list[float], eps: float = 1e-5) -> torch.Tensor:
    """[B, V] True where kernel and torch may rightly disagree: a logit whose tie group straddles
    the nucleus' edge (the mass above it within eps of p; torch's sort keeps part of a tie group),
    or one of zero probability (torch's sort path re-masks those even in rows without top-p)."""
    x = logits.double().cpu()
    edge = torch.zeros_like(x, dtype=torch.bool)
    for i, (k, p) in enumerate(zip(ks, ps)):
        row = x[i]
        if k < row.shape[0]:
            row = row.masked_fill(row < row.topk(k).values[-1], float("-inf"))
        prob = torch.softmax(row, 0)
        values, group = torch.unique(row, return_inverse=True)
        group_mass = torch.zeros(len(values), dtype=torch.float64).index_add_(0, group, prob)
        above = group_mass.flip(0).cumsum(0).flip(0) - group_mass  # the mass of larger logits
        low, high = above[group], (above + group_mass)[group]
        edge[i] = prob < 1e-30
        if p < 1.0:
            edge[i] |= (low < p + eps) & (high > p - eps)
    return edge


def assert_top_k_top_p_agree(logits, kernel_out, torch_out, ks, ps):
    kept_kernel, kept_torch = kernel_out == logits, torch_out == logits
    assert torch.equal(kernel_out[kept_kernel], logits[kept_kernel])  # kept logits are untouched
    assert torch.isneginf(kernel_out[~kept_kernel]).all()
    assert kept_kernel.gather(1, logits.argmax(1, keepdim=True)).all()  # the top logit survives
    disagree = (kept_kernel != kept_torch).cpu() & ~edge_tokens(logits, ks, ps)
    assert not disagree.any(), f"{int(disagree.sum())} logits kept by one side only, rows {disagree.any(1).nonzero().flatten().tolist()}"


@requires_kernels
@pytest.mark.parametrize("vocab", [8, 1000, 32_000, 151_936])
def test_top_k_top_p_kernel_matches_the_processor(vocab, monkeypatch):
    torch.manual_seed(vocab)
    settings = [(vocab, 1.0), (1, 1.0), (min(50, vocab - 1), 1.0), (vocab, 0.9), (min(40, vocab), 0.8),
                (vocab, 0.3), (min(3, vocab), 0.99), (vocab - 1, 0.5)]
    ks, ps = [k for k, _ in settings], [p for _, p in settings]
    logits = torch.randn(len(settings), vocab, device="cuda") * 3
    logits[2, : vocab // 2] = logits[2, vocab // 2]  # ties at the k-th logit all survive
    logits[4] = logits[4].round()  # ties everywhere
    logits[5, ::3] = float("-inf")  # banned tokens
    expected = TopKTopPProcessor.filter(logits.clone(), ks, ps)
    assert loader.kernels_for(top_k_top_p.SOURCE, (top_k_top_p.KERNEL,), logits.device) is not None, loader.kernel_error(top_k_top_p.SOURCE)
    out = top_k_top_p.top_k_top_p(logits.clone(), ks, ps)
    assert_top_k_top_p_agree(logits, out, expected, ks, ps)
    # Rows without top-p take the top-k threshold alone: exact.
    top_k_rows = [i for i, p in enumerate(ps) if p >= 1.0]
    only_k = TopKTopPProcessor.filter(logits[top_k_rows].clone(), [ks[i] for i in top_k_rows], [1.0] * len(top_k_rows))
    assert torch.equal(out[top_k_rows], only_k)
    # The processor sends CUDA logits to the kernel, not to its torch version.
    monkeypatch.setattr(TopKTopPProcessor, "filter", lambda *a: pytest.fail("the kernel should have run"))
    params = [SamplingParams(top_k=40, top_p=0.9)] * 2
    make_processor(vocab).apply(logits[:2].clone(), make_batch(params))


@requires_kernels
def test_top_k_top_p_kernel_fuzz_and_cuda_graph():
    generator = torch.Generator().manual_seed(7)
    for trial in range(20):
        vocab = int(torch.randint(2, 70_000, (1,), generator=generator))
        rows = int(torch.randint(1, 9, (1,), generator=generator))
        logits = (torch.randn(rows, vocab, generator=generator) * float(torch.rand(1, generator=generator) * 20)).cuda()
        ks = [vocab if r % 3 == 0 else int(torch.randint(1, vocab + 1, (1,), generator=generator)) for r in range(rows)]
        ps = [1.0 if r % 4 == 1 else float(torch.rand(1, generator=generator)) for r in range(rows)]
        expected = TopKTopPProcessor.filter(logits.clone(), ks, ps)
        assert_top_k_top_p_agree(logits, top_k_top_p.top_k_top_p(logits.clone(), ks, ps), expected, ks, ps)
    # Captured in a CUDA graph, it replays on whatever the static logits then hold.
    static = logits.clone()
    ks_t, ps_t = torch.tensor(ks, dtype=torch.int32, device="cuda"), torch.tensor(ps, device="cuda")
    eager = top_k_top_p.top_k_top_p_cuda(logits.clone(), ks_t, ps_t)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        top_k_top_p.top_k_top_p_cuda(static, ks_t, ps_t)
    static.copy_(logits)
    graph.replay()
    assert torch.equal(static, eager)


@requires_kernels
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("cache_dtype", DTYPES + [torch.int8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kv_kernel_matches_the_fallback_bit_for_bit(dtype, cache_dtype, heads, block_size):
    for head_dim in (64, 80, 128):  # 80: a half that is not a multiple of the warp
        x = make_rotary_inputs(tokens=13, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, dtype=dtype,
                               num_blocks=16 if block_size == 1 else 2, block_size=block_size, cache_dtype=cache_dtype,
                               device=torch.device("cuda"), seed=head_dim)
        assert loader.kernels_for(rotary_kv.SOURCE, rotary_kv.KERNELS, x.q.device) is not None, loader.kernel_error(rotary_kv.SOURCE)
        expected = reference_rotary_kv(x)  # torch on the same GPU: quantize_int8's CUDA rounding
        run_rotary_kv(x)
        assert_rotary_kv_equal(x, expected)


@requires_kernels
def test_rotary_kv_kernel_in_a_cuda_graph():
    x = make_rotary_inputs(dtype=torch.bfloat16, cache_dtype=torch.bfloat16, device=torch.device("cuda"))
    qkv, cache = x.qkv.clone(), x.cache.clone()
    expected = reference_rotary_kv(x)
    run_rotary_kv(x)  # compiles before capture
    x.qkv.copy_(qkv)
    x.cache.copy_(cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_rotary_kv(x)
    x.qkv.copy_(qkv)
    x.cache.copy_(cache)
    graph.replay()
    assert_rotary_kv_equal(x, expected)
