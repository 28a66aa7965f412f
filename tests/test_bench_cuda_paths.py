"""`cadenza bench` on real model shapes with dummy weights, beside transformers on the same device.

Everything the GPU run takes runs here on the CPU with a tiny shape: the device flags, the
transformers peers built from the config.json and filled with cadenza's very weights (transformers'
static cache compiled included), the nano-vllm workload, the engine sizing a GPU gets (with the
device faked) and the CUDA-event clock (with the events faked). Timings are never asserted.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from cadenza.bench.cli import add_bench_parser, hf_variants, main
from cadenza.bench.common import workload as workload_module
from cadenza.bench.common.device import WorkNeeds, elapsed_seconds, kv_blocks_for, plan_engine, read_bench_config

TINY_SHAPE = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=0, eos_token_id=2, tie_word_embeddings=False,
)
TINY_LATENCY = ["--prefill-lens", "8", "--decode-prompt-len", "8", "--decode-tokens", "3", "--repeats", "1",
                "--read-mib", "8", "--no-quiet-check"]


@pytest.fixture
def tiny_shape(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_SHAPE))
    return path


def dummy_args(shape, *extra: str) -> list[str]:
    return ["--model", str(shape), "--load-format", "dummy", "--device", "cpu", "--dtype", "float32", *extra]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


# --- end to end ---------------------------------------------------------------------------------


def test_latency_beside_transformers_eager_and_compiled_on_the_same_weights(tiny_shape, tmp_path, capsys):
    # Batch 1 for both decode measures: one shape, so one compile (cold, inductor takes ~25 s on 2 cores).
    out = tmp_path / "latency.json"
    code = main(["latency", *dummy_args(tiny_shape), *TINY_LATENCY, "--batch-size", "1", "--no-model-step",
                 "--compare", "hf", "--hf-variants", "generate", "compiled", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert f"{tiny_shape} (float32) on cpu" in printed
    assert "ceilings: memory read" in printed and "cadenza's decode over its ceiling: batch 1" in printed
    for engine in ("cadenza", "hf generate", "hf static+compile"):
        assert f"  {engine}: decode, batch 1" in printed
    result = json.loads(out.read_text())
    assert {row["engine"] for row in result["rows"]} == {"cadenza", "hf generate", "hf static+compile"}
    assert all(row["tokens_per_s"] > 0 and row["ceiling_tokens_per_s"] > 0 for row in result["rows"])
    assert result["ceilings"]["memory_measure"] == "memory read" and result["ceilings"]["memory_GBps"] > 0
    assert result["load_format"] == "dummy" and result["environment"]["device"] == "cpu"
    # transformers was filled with cadenza's very weights: in float32 greedy decoding agrees token for token.
    check = result["weights_check"]
    assert check["cadenza"] == check["hf"] and check["equal_from_start"] == check["num_tokens"] == 8
    assert "cadenza and transformers agree on the first 8 of 8" in printed


def test_throughput_runs_the_nano_vllm_workload_through_every_engine(tiny_shape, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(workload_module.NANO_VLLM, "num_requests", 3)  # its draws, fewer and shorter
    monkeypatch.setitem(workload_module.NANO_VLLM, "prompt_len", (4, 12))
    monkeypatch.setitem(workload_module.NANO_VLLM, "output_len", (2, 5))
    out = tmp_path / "throughput.json"
    code = main(["throughput", *dummy_args(tiny_shape), "--workload", "nano-vllm", "--no-quiet-check",
                 "--compare", "hf", "--hf-variants", "generate", "--hf-batch-size", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "workload: nano-vllm: 3 requests, prompts 4..12" in printed
    result = json.loads(out.read_text())
    expected = workload_module.nano_vllm_workload(vocab_size=320)
    runs = {r["engine"]: r for r in result["runs"]}
    assert set(runs) == {"cadenza", "hf-static (batch 2)"}  # (hf-continuous: tests/test_bench.py)
    for run in runs.values():  # EOS ignored everywhere: exactly the tokens asked
        assert run["output_tokens"] == expected.num_output_tokens and run["prompt_tokens"] == expected.num_prompt_tokens
    assert result["weights_check"]["equal_from_start"] == 8


def test_transformers_compiles_by_default_on_a_gpu_only(tiny_shape):
    args = parse("throughput", *dummy_args(tiny_shape))
    assert hf_variants(args, torch.device("cuda")) == ("generate", "compiled", "continuous")
    assert hf_variants(args, torch.device("cpu")) == ("generate", "continuous")
    chosen = parse("throughput", *dummy_args(tiny_shape), "--hf-variants", "compiled", "compiled")
    assert hf_variants(chosen, torch.device("cpu")) == ("compiled",)


def test_nano_vllm_preset_fixes_its_sizes(tiny_shape, capsys):
    code = main(["throughput", *dummy_args(tiny_shape), "--workload", "nano-vllm", "--num-requests", "4"])
    assert code == 2
    assert "--workload nano-vllm fixes the requests; leave out --num-requests" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_cuda_without_a_gpu_is_a_usage_error(tiny_shape, capsys):
    code = main(["latency", "--model", str(tiny_shape), "--load-format", "dummy", "--device", "cuda", "--no-quiet-check"])
    assert code == 2
    assert "no CUDA GPU is available" in capsys.readouterr().err


# --- pieces -------------------------------------------------------------------------------------


def test_nano_vllm_workload_is_nano_vllms_bench_draw_for_draw():
    w = workload_module.nano_vllm_workload(seed=0, vocab_size=128256)
    assert w.num_requests == 256 and w.temperature == 0.6
    assert w.num_output_tokens == 133_966  # what nano-vllm's bench prints as its total
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.max_tokens <= 1024 for r in w.requests)
    assert max(t for r in w.requests for t in r.prompt_token_ids) == 10_000  # randint(0, 10000): inclusive
    small = workload_module.nano_vllm_workload(seed=0, vocab_size=320)
    assert max(t for r in small.requests for t in r.prompt_token_ids) < 320


def test_engine_plan_on_cpu_raises_the_batch_and_keeps_the_cache(tiny_shape):
    args = parse("latency", *dummy_args(tiny_shape), "--batch-size", "100")
    config, arch = read_bench_config(args)
    assert arch.vocab_size == 320 and config.model.load_format == "dummy"
    plan = plan_engine(args, config, arch, WorkNeeds((50,) * 100, alone=1026))
    assert plan.device == torch.device("cpu")
    assert plan.overrides["scheduler.max_num_seqs"] == 100 and plan.overrides["model.load_format"] == "dummy"
    assert "cache.num_blocks" not in plan.overrides and "attention_backend" not in plan.overrides
    given = parse("latency", *dummy_args(tiny_shape), "--max-num-seqs", "8", "--kv-cache-memory", "64MiB")
    plan = plan_engine(given, *read_bench_config(given), WorkNeeds((50,) * 100))
    assert plan.overrides["scheduler.max_num_seqs"] == 8 and plan.overrides["cache.memory_budget"] == "64MiB"


def test_engine_plan_on_a_gpu_sizes_the_cache_for_the_work_and_picks_triton(tiny_shape, monkeypatch):
    import cadenza.runner.device

    monkeypatch.setattr(cadenza.runner.device, "resolve_device", lambda name: torch.device("cuda"))  # plan_engine's
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    args = parse("throughput", *dummy_args(tiny_shape), "--compare", "hf")
    needs = WorkNeeds((40, 17, 16))  # blocks of 16: 3 + 2 + 1
    plan = plan_engine(args, *read_bench_config(args), needs)
    assert plan.overrides["attention_backend"] == "triton"
    assert plan.overrides["cache.num_blocks"] == 6 + 8  # and the warm-up's headroom
    assert any("all at once" in note for note in plan.notes)
    named = parse("throughput", *dummy_args(tiny_shape), "--attention-backend", "torch_sdpa", "--kv-cache-memory", "1GiB")
    plan = plan_engine(named, *read_bench_config(named), needs)
    assert plan.overrides["attention_backend"] == "torch_sdpa" and "cache.num_blocks" not in plan.overrides


def test_kv_blocks_are_capped_by_the_memory_the_weights_leave():
    needs = WorkNeeds((1000,) * 10)  # 63 blocks of 16 each, 630 with the headroom 638
    assert kv_blocks_for(needs, 16, 1 << 20, free_bytes=10 << 30, weight_bytes=1 << 30, with_hf=False) == (638, "")
    # 0.9 * 2 GiB - 2 x 0.5 GiB = 0.8 GiB, half of it beside transformers: 409 blocks of 1 MiB.
    blocks, note = kv_blocks_for(needs, 16, 1 << 20, free_bytes=2 << 30, weight_bytes=1 << 29, with_hf=True)
    assert blocks == 409 and "holds 409 of the 638 blocks" in note
    with pytest.raises(ValueError, match="too little"):
        kv_blocks_for(needs, 16, 1 << 20, free_bytes=1 << 30, weight_bytes=1 << 30, with_hf=True)


def test_gpu_timing_reads_cuda_events_after_synchronizing(monkeypatch):
    calls = []

    class FakeEvent:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self) -> None:
            calls.append("record")

        def synchronize(self) -> None:
            calls.append("wait")

        def elapsed_time(self, end: FakeEvent) -> float:
            return 2.5  # milliseconds, as CUDA reports

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    seconds = elapsed_seconds(lambda: calls.append("work"), torch.device("cuda"))
    assert seconds == pytest.approx(2.5e-3)
    assert calls == ["sync", "record", "work", "record", "wait"]
    assert elapsed_seconds(lambda: None, torch.device("cpu")) >= 0


def test_ceilings_take_a_device_copy_on_a_gpu_and_the_read_rate_on_a_cpu(monkeypatch):
    from cadenza.bench.offline import ceilings

    assert ceilings.device_copy_bandwidth(1 << 20, torch.device("cpu")) > 0  # the GPU's measure, run here
    cpu = ceilings.measure_ceilings(read_bytes=1 << 20, matmul_shape=(8, 16, 16))
    assert cpu.memory_measure == "memory read" and cpu.matmul_shape == (8, 16, 16)
    monkeypatch.setattr(ceilings, "device_copy_bandwidth", lambda num_bytes, device: 3e12)
    monkeypatch.setattr(ceilings, "matmul_rate", lambda dtype, m, k, n, device: 7e14 if dtype == torch.bfloat16 else 5e13)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    gpu = ceilings.measure_ceilings(device=torch.device("cuda"))
    assert gpu.memory_measure == "device copy" and gpu.matmul_shape == ceilings.CUDA_MATMUL_SHAPE
    assert gpu.as_dict()["memory_GBps"] == 3000 and gpu.matmul(torch.bfloat16) == 7e14
