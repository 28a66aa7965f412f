"""Tensor parallelism on 2 gloo ranks over loopback: the split model computes what the whole one
does. Rank 0 runs in this process (its `Runtime`); rank 1 is a child process that every test stops."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest
import torch
from tiny_models import build_tiny_model

from cadenza.config import load_config
from cadenza.engine.async_engine import AsyncEngine
from cadenza.models.quantized_linear import QuantizedLinear
from cadenza.parallel.errors import ShardingError
from cadenza.parallel.partition import even_ranges, partition
from cadenza.runtime.build import Runtime, build_runtime
from cadenza.sampling_params import SamplingParams
from cadenza.step import ScheduledChunk
from cadenza.threads import compute_thread

PROMPTS = [list(range(5, 40)), [30, 31, 32], list(range(100, 117))]


# --- the partition, without processes -------------------------------------------------------------


def test_even_ranges_cover_everything_once():
    assert even_ranges(9, 2) == [(0, 5), (5, 9)]
    assert even_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_kv_heads_are_split_then_replicated_when_ranks_outnumber_them():
    kw = dict(intermediate_size=128, vocab_size=320)
    uneven = [partition(num_heads=6, num_kv_heads=3, world_size=2, rank=r, **kw) for r in range(2)]
    assert [(p.q_heads, p.kv_heads) for p in uneven] == [((0, 4), (0, 2)), ((4, 6), (2, 3))]
    one_kv = [partition(num_heads=4, num_kv_heads=1, world_size=2, rank=r, **kw) for r in range(2)]
    assert [(p.q_heads, p.kv_heads) for p in one_kv] == [((0, 2), (0, 1)), ((2, 4), (0, 1))]
    assert [p.vocab for p in one_kv] == [(0, 160), (160, 320)]


@pytest.mark.parametrize(
    "heads, kv, world, problem",
    [(4, 2, 8, "exceeds the model's 4 attention heads"), (6, 2, 4, "do not split over 2 ranks"), (4, 2, 3, "not a multiple")],
)
def test_impossible_splits_name_the_problem(heads, kv, world, problem):
    with pytest.raises(ShardingError, match=problem):
        partition(num_heads=heads, num_kv_heads=kv, intermediate_size=128, vocab_size=320, world_size=world, rank=0)


# --- the split model against the whole one ------------------------------------------------------


def make_runtime(model: Path | None, tp: int, **overrides) -> Runtime:
    values = {"parallel.tensor_parallel_size": tp, "parallel.timeout_seconds": 30, "cache.num_blocks": 64, **overrides}
    if model is not None:
        values["model.path"] = str(model)
    return build_runtime(load_config(None, overrides=values, env={}))


def greedy_logits(runtime: Runtime, steps: int, forced: list[list[int]] | None = None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill PROMPTS in one step, then decode `steps - 1` greedy steps; logits and tokens per step.
    `forced`: each step's input tokens from another run (teacher forcing), so that both runs' logits
    stay comparable after a near-tie picks differently."""
    params = SamplingParams(temperature=0)
    tables = [tuple(range(i * 4, i * 4 + 4)) for i in range(len(PROMPTS))]
    lens = [len(p) for p in PROMPTS]
    chunks = [ScheduledChunk(f"r{i}", p, 0, tables[i], True, params, p, 0) for i, p in enumerate(PROMPTS)]
    logits, tokens = [], []
    for step in range(steps):
        result = compute_thread.run_sync(runtime.runner.execute, chunks, True)
        logits.append(result.logits)
        tokens.append(result.sampled.token_ids.tolist())
        chunks = [
            ScheduledChunk(f"r{i}", [t], lens[i] + step, tables[i], True, params, PROMPTS[i], step + 1)
            for i, t in enumerate(tokens[-1] if forced is None else forced[step])
        ]
    return logits, tokens


def run_both(model: Path | None, steps: int, teacher_forced: bool = False, **overrides):
    """TP=1's and TP=2's (logits, tokens); `teacher_forced`: TP=2 decodes TP=1's tokens."""
    results = []
    for tp in (1, 2):
        runtime = make_runtime(model, tp, **overrides)
        try:
            forced = results[0][1] if teacher_forced and results else None
            results.append(greedy_logits(runtime, steps, forced))
        finally:
            runtime.close()
        assert runtime.failure() is None
    return results


TINY = {
    "llama3": ("llama3", {}),
    "smollm_tied": ("smollm_tied", {}),  # 1 KV head for 2 ranks (replicated), tied embeddings
    "qwen3": ("qwen3", {}),  # untied, q/k norms
    "odd_heads": ("llama2_bias", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, vocab_size=321)),  # 2 + 1 KV heads; 161 + 160 vocabulary rows
    # Mixtures: every expert's width split over the ranks, one all-reduce a layer (its second layer dense).
    "qwen3_moe": ("qwen3_moe", {}),
    "gpt_oss": ("gpt_oss", {}),  # sinks split with their heads; biased experts, the down bias counted once
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_tp2_logits_and_greedy_tokens_match_tp1_on_tiny_models(name, tmp_path_factory):
    arch, extra = TINY[name]
    model = build_tiny_model(tmp_path_factory.mktemp(name), arch, **extra)
    (whole, whole_tokens), (split, split_tokens) = run_both(model, steps=4, **{"model.dtype": "float32"})
    assert split_tokens == whole_tokens
    for a, b in zip(whole, split):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


def test_tp2_runs_a_mixtures_quantized_experts_split_on_their_blocks(tmp_path):
    """Qwen3-MoE's experts quantized on load (Q8_0): each rank's share of every expert's width is
    whole blocks, so they stay quantized on the experts kernel, and TP=2 agrees with TP=1 to the
    activations' int8 rounding."""
    model = build_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    quantized = {"model.dtype": "bfloat16", "model.quantization": "int8"}
    runtime = make_runtime(model, 2, **quantized)
    try:
        from tests.test_moe import mixtures

        experts = [e for moe in mixtures(runtime.loaded) for e in moe.experts]
        assert all(isinstance(e.down_proj, QuantizedLinear) and e.down_proj.in_features == 32 for e in experts)
        assert all(moe.fused is not None for moe in mixtures(runtime.loaded))
    finally:
        runtime.close()
    (whole, whole_tokens), (split, _) = run_both(model, steps=3, teacher_forced=True, **quantized)
    for a, b in zip(whole, split):
        assert (a - b).abs().max() < 0.1 * a.abs().max()


def test_tp2_on_the_default_gguf_runs_the_quantized_blocks_and_agrees_with_tp1():
    # Activations are rounded to int8 per 32 values: a last-bit difference from the all-reduce's
    # summation order can move a rounding, so logits agree loosely, and a greedy pick may differ
    # only where TP=1's top two logits are closer than the two runs' logits are to each other.
    # TP=2 decodes TP=1's tokens, so every step compares the same inputs.
    (whole, whole_tokens), (split, split_tokens) = run_both(None, steps=4, teacher_forced=True)
    for a, b, want, got in zip(whole, split, whole_tokens, split_tokens):
        assert (a - b).abs().max() < 0.1 * a.abs().max()
        for row, (w, g) in enumerate(zip(want, got)):
            assert w == g or a[row, w] - a[row, g] <= 2 * (a[row] - b[row]).abs().max(), (row, w, g)
    differing = sum(w != g for want, got in zip(whole_tokens, split_tokens) for w, g in zip(want, got))
    assert differing <= 2, (whole_tokens, split_tokens)


def test_forty_mixed_requests_batched_equal_their_solo_results(tiny_model_dir):
    model = tiny_model_dir("llama3")
    prompts = [[(7 * i + j) % 300 + 3 for j in range(3 + (i * 5) % 23)] for i in range(40)]
    params = [SamplingParams(temperature=0, max_tokens=2 + i % 9, ignore_eos=True) for i in range(40)]

    async def generate(engine: AsyncEngine, prompt, p) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(prompt, p):
            assert out.finish_reason != "error", out.error
            tokens += out.token_ids
        return tokens

    async def batched_and_solo(runtime: Runtime):
        results: list[list[int] | None] = [None] * 40
        async with AsyncEngine.serve(runtime) as engine:
            async with anyio.create_task_group() as tg:
                for i in range(40):
                    async def one(i=i):
                        results[i] = await generate(engine, prompts[i], params[i])
                    tg.start_soon(one)
            solo = [await generate(engine, prompts[i], params[i]) for i in range(40)]
        return results, solo

    outcomes = []
    for tp in (1, 2):
        runtime = make_runtime(model, tp, **{"model.dtype": "float32", "cache.num_blocks": 256})
        try:
            outcomes.append(anyio.run(batched_and_solo, runtime))
        finally:
            runtime.close()
    (batched1, _), (batched2, solo2) = outcomes
    assert batched2 == solo2
    assert batched2 == batched1
    assert all(len(t) == p.max_tokens for t, p in zip(batched2, params))


def test_a_rank_killed_mid_run_fails_the_requests_and_the_engine_and_nothing_hangs(tiny_model_dir):
    runtime = make_runtime(tiny_model_dir("llama3"), 2, **{"model.dtype": "float32", "parallel.timeout_seconds": 10})
    (rank1,) = runtime.parallel.processes.values()
    outcomes: list[tuple[str | None, str | None]] = []

    async def scenario():
        async with AsyncEngine.serve(runtime) as engine:
            first_tokens = anyio.Event()

            async def one(i: int):
                last = None
                async for out in engine.generate([5 + i, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True)):
                    first_tokens.set()
                    last = out
                outcomes.append((last.finish_reason, last.error_code))

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
                await first_tokens.wait()
                os.kill(rank1.pid, signal.SIGKILL)
            with anyio.fail_after(10):  # the engine notices within its poll of the group
                while engine.healthy:
                    await anyio.sleep(0.05)
            assert "rank" in engine.unhealthy_reason

    try:
        anyio.run(scenario)
    finally:
        runtime.close()
    assert len(outcomes) == 4
    assert all(reason == "error" for reason, _ in outcomes), outcomes
    assert rank1.poll() is not None


def test_serve_with_tp2_spawns_its_rank_and_health_fails_when_it_dies(tiny_model_dir):
    import httpx
    import psutil
    from server_process import running_server

    with running_server(tiny_model_dir("llama3"), "--tensor-parallel-size", "2") as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        (rank1,) = psutil.Process(server.proc.pid).children()
        assert "cadenza.runtime.worker" in " ".join(rank1.cmdline())
        rank1.kill()
        with _deadline(10):
            while httpx.get(f"{server.url}/health").status_code == 200:
                pass
        body = httpx.get(f"{server.url}/health").json()
        assert "rank 1" in str(body)
        assert server.stop() == 0
    assert not rank1.is_running()


@contextmanager
def _deadline(seconds: int):
    """Fail a polling loop that outlives `seconds`: a bound against hanging, not a timing assertion."""

    def expired(*_):
        raise TimeoutError(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_torchrun_makes_rank_0_the_server_and_rank_1_a_model_worker(tiny_model_dir):
    import subprocess
    import sys
    import threading

    import httpx

    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
               "-m", "cadenza", "serve", "--tensor-parallel-size", "2", "--model", str(tiny_model_dir("llama3")),
               "--dtype", "float32", "--host", "127.0.0.1", "--port", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CADENZA_LOGGING__FORMAT": "json"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    url: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            if "cadenza listening on " in line and not url:
                url.append(line.split("cadenza listening on ")[1].strip())
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(120) and url, "torchrun's rank 0 never served"
        assert httpx.get(f"{url[0]}/health").status_code == 200
        model = httpx.get(f"{url[0]}/v1/models").json()["data"][0]["id"]
        reply = httpx.post(f"{url[0]}/v1/completions", json={"model": model, "prompt": "fox", "max_tokens": 3}, timeout=30)
        assert reply.status_code == 200, reply.text
        import psutil

        ranks = psutil.Process(proc.pid).children(recursive=True)
        assert len(ranks) >= 2
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on to its ranks and exits
        proc.wait(60)
        psutil.wait_procs(ranks, timeout=30)
        assert not any(rank.is_running() for rank in ranks)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --- splitting GGUF blocks, without processes -------------------------------------------------------


def _q8_linear(out_features: int, in_features: int):
    """A Q8_0 linear as loaded: sharded before `use_cpu_kernels` (which may re-lay its blocks)."""
    from cadenza.models.int8_weights import quantize_q8_0
    from cadenza.models.quantized_linear import QuantizedLinear

    linear = QuantizedLinear(in_features, out_features, bias=False)
    linear.load_rows(0, quantize_q8_0(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))))
    linear.finish_loading()
    return linear


def test_row_parallel_blocks_split_at_block_boundaries_sum_to_the_whole(kernels):
    from cadenza.models.quantized_linear import QuantizedLinear
    from cadenza.parallel.tensor_parallel import _cols, _rows

    whole = _q8_linear(48, 128)
    x = torch.randn(3, 128)
    halves = [_cols(whole, (0, 64), True, "t"), _cols(whole, (64, 128), False, "t")]
    assert all(isinstance(h, QuantizedLinear) for h in halves)  # native blocks, cut between them
    rows = _rows(whole, [(8, 16), (40, 48)])
    for linear in (*halves, rows, whole):
        linear.use_cpu_kernels(kernels)
    torch.testing.assert_close(halves[0](x[:, :64]) + halves[1](x[:, 64:]), whole(x), atol=1e-4, rtol=1e-5)
    full = whole(x)
    assert torch.equal(rows(x), torch.cat([full[:, 8:16], full[:, 40:48]], dim=1))


def test_a_row_parallel_split_inside_a_block_falls_back_to_float(kernels):
    from cadenza.parallel.tensor_parallel import _cols, _dequantize

    whole = _q8_linear(16, 96)
    part = _cols(whole, (0, 48), True, "t")  # 48 is not a multiple of Q8_0's 32 values
    assert isinstance(part, torch.nn.Linear) and part.weight.dtype == torch.float32
    assert torch.equal(part.weight, _dequantize(whole)[:, :48])
