"""The GPU engine's step, checked on the CPU: one packed copy of a step's inputs, a decode call
with no host sync (it compiles whole with `torch.compile(fullgraph=True)`), and the bucketed,
padded, static-buffer decode runner whose tokens equal the unpadded step's. Where CUDA is present
the same runner captures graphs and a step runs under `torch.cuda.set_sync_debug_mode("error")`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cadenza.config import ConfigError
from cadenza.config.loader import load_config
from cadenza.llm import LLM
from cadenza.runner.cuda_graphs import DecodeGraphRunner, batch_buckets
from cadenza.runner.step_inputs import PAD_SLOT, StepLayout, StepPacker
from cadenza.runtime.build import build_runtime
from cadenza.sampling_params import SamplingParams
from cadenza.step import ScheduledChunk

CUDA = torch.cuda.is_available()


def test_buckets_are_one_two_four_eight_then_steps_of_eight_up_to_the_batch_limit():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(256) == [1, 2, 4, 8, *range(16, 257, 8)]


def chunk(rid, tokens, start, table, sample=True):
    return ScheduledChunk(rid, tokens, start, table, sample, SamplingParams(temperature=0), (1,))


def test_a_step_is_packed_in_one_array_with_every_field_a_view_of_it():
    packer = StepPacker(torch.device("cpu"), block_size=4)
    chunks = [chunk("a", [5, 6, 7], 2, [3, 9]), chunk("b", [8], 6, [1, 4]), chunk("c", [1, 2], 0, [7], sample=False)]
    inputs = packer.pack(chunks, sample_rows=[2, 3])
    base = inputs.input_ids.untyped_storage().data_ptr()
    meta = inputs.meta
    for t in (inputs.positions, inputs.sample_rows, meta.slot_mapping, meta.seq_lens, meta.block_tables, meta.query_start_loc):
        assert t.untyped_storage().data_ptr() == base
    assert inputs.input_ids.tolist() == [5, 6, 7, 8, 1, 2]
    assert inputs.positions.tolist() == [2, 3, 4, 6, 0, 1]
    # position p of a sequence lives at table[p // 4] * 4 + p % 4
    assert meta.slot_mapping.tolist() == [3 * 4 + 2, 3 * 4 + 3, 9 * 4 + 0, 4 * 4 + 2, 7 * 4 + 0, 7 * 4 + 1]
    assert meta.query_start_loc.tolist() == [0, 3, 4, 6] and meta.seq_lens.tolist() == [5, 7, 2]
    assert meta.context_lens.tolist() == [2, 6, 0] and meta.block_tables.tolist() == [[3, 9], [1, 4], [7, 0]]
    assert meta.query_lens_list == [3, 1, 2] and meta.max_seq_len == 7 and inputs.sample_rows.tolist() == [2, 3]


def test_a_padded_decode_has_padding_rows_that_write_nothing_and_read_no_key():
    packer = StepPacker(torch.device("cpu"), block_size=4)
    static = torch.full((StepLayout(4, 4, 3, 4, padded=True).size,), 99, dtype=torch.int64)
    inputs = packer.pack([chunk("a", [5], 6, [1, 2]), chunk("b", [8], 0, [3])], [0, 1], pad_to=4, table_width=3, into=static)
    meta = inputs.meta
    assert inputs.input_ids.data_ptr() == static.data_ptr()  # the graph's static buffer
    assert inputs.input_ids.tolist() == [5, 8, 0, 0] and meta.slot_mapping.tolist()[2:] == [PAD_SLOT] * 2
    assert meta.seq_lens.tolist() == [7, 1, 0, 0] and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    # Column-major, and only the columns these sequences use were filled and sent: the third
    # keeps what the buffer held (no kernel reads past a row's blocks).
    assert meta.block_tables.stride() == (1, 4) and meta.block_tables[:, 2].tolist() == [99] * 4
    assert meta.block_tables[:, :2].tolist() == [[1, 2], [3, 0], [0, 0], [0, 0]]
    assert inputs.num_sent == StepLayout(4, 4, 3, 4, padded=True).sent(2) == StepLayout(4, 4, 3, 4, padded=True).size - 4
    assert meta.is_decode_only and inputs.num_real_tokens == 2 and inputs.sample_rows.tolist() == [0, 1]
    with pytest.raises(ValueError, match="wider than the static 1"):
        packer.pack([chunk("a", [5], 6, [1, 2])], [0], pad_to=1, table_width=1, into=static)
    with pytest.raises(ValueError, match="only a decode"):
        packer.pack([chunk("a", [5, 6], 6, [1, 2])], [1], pad_to=2, table_width=3, into=static)


def greedy_tokens(model_path, prompts, **overrides):
    # Each request stops at another length: the batch shrinks through the buckets 8, 4, 2, 1.
    params = [SamplingParams(temperature=0, max_tokens=3 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    settings = {"model.dtype": "float32", "cache.block_size": 8, "model.cpu_kernels": "off", **overrides}
    with LLM(model_path, **settings) as llm:
        graphs = llm.runtime.runner.graphs
        outputs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outputs], graphs


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_padded_static_buffer_decodes_give_the_unpadded_steps_tokens(model_path, cache_dtype):
    prompts = [[(7 * i + j) % 300 + 3 for j in range(3 + 4 * i)] for i in range(5)]
    common = {"cache.dtype": cache_dtype, "attention_backend": "triton", "max_num_seqs": 8}
    padded, graphs = greedy_tokens(model_path, prompts, **{"model.cuda_graphs": "on"}, **common)
    plain, none = greedy_tokens(model_path, prompts, **{"model.cuda_graphs": "off"}, **common)
    reference, _ = greedy_tokens(model_path, prompts, **{"cache.dtype": cache_dtype})  # torch_sdpa, unpadded
    assert isinstance(graphs, DecodeGraphRunner) and graphs.buckets == [1, 2, 4, 8] and none is None
    assert graphs.capture == CUDA
    assert padded == plain == reference


def test_cuda_graphs_on_needs_a_backend_that_pads(model_path):
    config = load_config(None, overrides={"model.path": str(model_path), "model.cuda_graphs": "on",
                                          "attention_backend": "torch_sdpa"}, env={})  # fmt: skip
    with pytest.raises(ConfigError, match="'torch_sdpa' cannot pad decode steps"):
        build_runtime(config)


def test_the_decode_call_compiles_whole_so_it_never_waits_on_the_host(model_path):
    """`fullgraph=True` fails on any graph break: `.item()`, `.tolist()`, `.cpu()`, data-dependent
    Python. Dynamo alone (backend="eager") checks that without paying for code generation."""
    config = load_config(None, overrides={"model.path": str(model_path), "model.dtype": "float32", "model.cpu_kernels": "off",
                                          "attention_backend": "triton", "cache.block_size": 8}, env={})  # fmt: skip
    runtime = build_runtime(config)
    runner = runtime.runner
    prompt = list(range(3, 14))
    runner.execute([chunk("a", prompt, 0, [0, 1])])  # a prefill fills the cache
    inputs = runner._packer.pack([chunk("a", [9], len(prompt), [0, 1])], [0])
    model, caches, backend, meta = runner.model, runner.kv_caches, runner.backend, inputs.meta

    def decode(input_ids, positions):
        return model(input_ids, positions, caches, meta, backend)

    torch._dynamo.reset()
    compiled = torch.compile(decode, fullgraph=True, backend="eager")
    snapshot = [c.clone() for c in caches]
    expected = decode(inputs.input_ids, inputs.positions)
    for cache, saved in zip(caches, snapshot):
        cache.copy_(saved)
    torch.testing.assert_close(compiled(inputs.input_ids, inputs.positions), expected, rtol=0, atol=0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_cuda_decode_step_never_synchronizes_with_the_host(model_path):
    with LLM(model_path, **{"model.device": "cuda", "model.dtype": "bfloat16", "model.cuda_graphs": "off"}) as llm:
        runner = llm.runtime.runner
        prompt = list(range(3, 14))
        runner.execute([chunk("a", prompt, 0, [0, 1])])
        inputs = runner._packer.pack([chunk("a", [9], len(prompt), [0, 1])], [0])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, runner.backend)
        finally:
            torch.cuda.set_sync_debug_mode("default")


ENGINE_ON_KERNELS = textwrap.dedent("""
    import json, sys
    import torch
    from cadenza.config.loader import load_config
    from cadenza.llm import LLM
    from cadenza.sampling_params import SamplingParams

    path, cache_dtype = sys.argv[1], sys.argv[2]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [[(7 * i + j) % 300 + 3 for j in range(3 + 9 * i)] for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(3)]
    common = {"model.path": path, "model.dtype": "float32", "model.device": device, "cache.block_size": 8,
              "cache.dtype": cache_dtype, "model.cpu_kernels": "off", "scheduler.max_num_seqs": 4}
    kernels = {"attention_backend": "triton", "plugin_options": {"triton": {"implementation": "triton"}},
               "model.cuda_graphs": "on"}
    tokens = {}
    for name, extra in (("eager", {"attention_backend": "eager"}), ("triton", kernels)):
        with LLM(config=load_config(None, overrides={**common, **extra}, env={})) as llm:
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    print(json.dumps(tokens))
""")


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_the_engine_on_the_triton_kernels_gives_the_reference_backends_tokens(model_path, cache_dtype):
    """Prefill, extends and bucket-padded decodes through the Triton kernels themselves (under
    Triton's interpreter here; natively and captured where CUDA is), in a child process so the
    interpreter is set before triton loads."""
    env = {**os.environ, "CADENZA_LOGGING__LEVEL": "warning"}
    if not CUDA:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", ENGINE_ON_KERNELS, str(model_path), cache_dtype],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert tokens["triton"] == tokens["eager"] and [len(t) for t in tokens["eager"]] == [4, 6, 8]


def test_every_buckets_fields_start_64_bytes_aligned():
    """Triton specializes its kernels on each pointer's 16-byte alignment: a field starting at a
    different alignment in each bucket's layout would compile each bucket's own variants."""
    for bucket in batch_buckets(256):
        for layout in (StepLayout(bucket, bucket, 64, bucket, padded=True), StepLayout(bucket + 3, bucket, 5, 2)):
            assert all(start * 8 % 64 == 0 for start, _ in layout.spans().values())  # int64s


SEEDED_ON_KERNELS = textwrap.dedent("""
    import json, sys
    from cadenza.config.loader import load_config
    from cadenza.kernels.triton import sampling
    from cadenza.llm import LLM
    from cadenza.sampling_params import SamplingParams

    calls = []
    sample = sampling.sample
    sampling.sample = lambda *args: calls.append(len(args[0])) or sample(*args)
    overrides = {"model.path": sys.argv[1], "model.dtype": "float32", "model.device": "cpu", "cache.block_size": 8,
                 "model.cpu_kernels": "off", "attention_backend": "triton",
                 "plugin_options": {"triton": {"implementation": "triton"}}}
    def params(**kw):
        return SamplingParams(max_tokens=6, ignore_eos=True, **kw)
    with LLM(config=load_config(None, overrides=overrides, env={})) as llm:
        alone = llm.generate([[5, 9, 14]], [params(seed=7, temperature=0.9)])[0].outputs[0].token_ids
        batched = [o.outputs[0].token_ids for o in llm.generate(
            [[3, 4], [5, 9, 14], [8, 8, 8, 8]], [params(seed=8, temperature=0.9), params(seed=7, temperature=0.9),
                                                 params(temperature=0)])]
    print(json.dumps({"alone": alone, "batched": batched, "calls": calls}))
""")


def test_seeded_sampling_on_the_one_pass_kernel_depends_on_the_seed_alone(model_path):
    """Where the Triton kernels run (the interpreter here), sampled steps take the one-pass sampler:
    a seeded request draws the same tokens alone and batched with others, another seed others."""
    env = {**os.environ, "CADENZA_LOGGING__LEVEL": "warning"}
    if not CUDA:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", SEEDED_ON_KERNELS, str(model_path)], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["alone"]) == 6 and result["batched"][1] == result["alone"]
    assert result["batched"][0] != result["alone"]
    assert result["calls"] and max(result["calls"]) == 3  # every row of the mixed batch in one call
