"""`cadenza bench`: end to end on a tiny random model, with tiny sizes. Timings are never asserted."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch

from cadenza.bench.cli import main
from cadenza.bench.common import quiet
from cadenza.bench.common.report import table
from cadenza.bench.common.workload import make_workload
from cadenza.bench.offline.ceilings import Ceilings, ModelCost
from cadenza.bench.peers.llamacpp import write_gguf_as
from cadenza.bench.peers.llamacpp_build import why_binaries_missing
from cadenza.models.config import ModelArchConfig, RopeConfig

TINY_THROUGHPUT = ["--num-requests", "4", "--prompt-len", "4", "24", "--output-len", "2", "6", "--no-quiet-check"]
TINY_LATENCY = ["--prefill-lens", "8", "16", "--decode-prompt-len", "8", "--decode-tokens", "3", "--batch-size", "3",
                "--repeats", "1", "--read-mib", "16", "--no-quiet-check"]


# --- end to end ---------------------------------------------------------------------------------


def test_throughput_with_hf_peers(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    code = main(["throughput", "--model", str(tiny_model_dir("llama3")), *TINY_THROUGHPUT,
                 "--hf-batch-size", "2", "--compare", "hf", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    for column in ("engine", "seconds", "output tok/s", "total tok/s", "cadenza/peer", "machine"):
        assert column in printed
    for engine in ("cadenza", "hf-static (batch 2)", "hf-continuous"):
        assert engine in printed
    assert "workload: 4 requests" in printed
    result = json.loads(out.read_text())
    runs = {r["engine"]: r for r in result["runs"]}
    workload = make_workload(4, (4, 24), (2, 6), seed=0, vocab_size=320)
    # Every engine produced exactly what the workload asked for: EOS is ignored everywhere.
    for run in runs.values():
        assert run["output_tokens"] == workload.num_output_tokens
        assert run["prompt_tokens"] == workload.num_prompt_tokens
        assert run["quiet"]["summary"].startswith(("quiet", "disturbed"))
    assert runs["hf-static (batch 2)"]["computed_output_tokens"] >= workload.num_output_tokens
    assert "cadenza_over_peer_output" in runs["hf-continuous"]
    # The paged cache's waste at its peak: at most one partly filled block per request, of 16 slots.
    cadenza = runs["cadenza"]
    assert 0 < cadenza["kv_slots_allocated_peak"] <= 4 * (24 + 6 + 15) and 0 <= cadenza["kv_unused_at_peak"] < 1
    assert "allocated-but-unused slots were" in printed


def test_throughput_llamacpp_needs_a_gguf(tiny_model_dir, capsys):
    code = main(["throughput", "--model", str(tiny_model_dir("llama3")), *TINY_THROUGHPUT, "--compare", "llamacpp"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "llama.cpp: skipped (" in printed


def test_latency_with_hf_peer(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    code = main(["latency", "--model", str(tiny_model_dir("llama3")), *TINY_LATENCY, "--compare", "hf", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "ceilings: memory read" in printed
    for column in ("measure", "tok/s", "ceiling tok/s", "achieved", "% bf16 mm", "% fp32 mm"):
        assert column in printed
    for measure in ("decode, batch 1, ctx 8+3", "prefill 8", "prefill 16", "decode, batch 3, ctx 8+3"):
        assert measure in printed
    result = json.loads(out.read_text())
    engines = {row["engine"] for row in result["rows"]}
    assert engines == {"cadenza", "cadenza model step", "hf generate"}
    assert len(result["rows"]) == 3 * 4
    assert all(row["tokens_per_s"] > 0 and row["ceiling_tokens_per_s"] > 0 for row in result["rows"])
    assert result["ceilings"]["memory_GBps"] > 0 and result["ceilings"]["memory_measure"] == "memory read"


def test_bad_workload_is_a_usage_error(tiny_model_dir, capsys):
    code = main(["throughput", "--model", str(tiny_model_dir("llama3")), "--num-requests", "2",
                 "--prompt-len", "9", "3", "--no-quiet-check"])
    assert code == 2
    assert "prompt_len" in capsys.readouterr().err


# --- pieces -------------------------------------------------------------------------------------


def test_workload_is_seeded():
    a = make_workload(8, (3, 9), (2, 5), seed=7, vocab_size=50)
    b = make_workload(8, (3, 9), (2, 5), seed=7, vocab_size=50)
    c = make_workload(8, (3, 9), (2, 5), seed=8, vocab_size=50)
    assert a == b and a != c
    assert all(3 <= len(r.prompt_token_ids) <= 9 and 2 <= r.max_tokens <= 5 for r in a.requests)
    assert all(0 <= t < 50 for r in a.requests for t in r.prompt_token_ids)
    assert a.num_output_tokens == sum(r.max_tokens for r in a.requests)


def test_model_cost_counts_the_projections():
    arch = ModelArchConfig(
        model_type="llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0),
        max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False,
        qk_norm=False, sliding_window=None, bos_token_id=None, eos_token_ids=(),
    )
    cost = ModelCost.from_arch(arch, torch.bfloat16)
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 8 * 32 + 16 * 8
    assert cost.body_params == 2 * per_layer
    assert cost.head_params == 800
    assert cost.weight_bytes == 2 * (2 * per_layer + 800)
    assert cost.decode_flops(0) == 2 * (2 * per_layer + 800)
    ceilings = Ceilings(memory_bandwidth=1e9, matmul_bf16=1e9, matmul_fp32=1e8, matmul_shape=(1, 1, 1))
    # Batch 1 is bound by reading the weights; a big batch by the matmuls.
    assert cost.decode_step_seconds(ceilings, torch.bfloat16, 1, 0) == pytest.approx(cost.weight_bytes / 1e9)
    assert cost.decode_step_seconds(ceilings, torch.bfloat16, 1000, 0) == pytest.approx(1000 * cost.decode_flops(0) / 1e9)


def test_model_cost_of_a_mixture_counts_the_experts_a_step_reads():
    from dataclasses import replace

    from cadenza.models.config import MoEConfig

    dense = ModelArchConfig(
        model_type="qwen3_moe", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0),
        max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False,
        qk_norm="head", sliding_window=None, bos_token_id=None, eos_token_ids=(),
    )
    arch = replace(dense, moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=4, normalize_top_k=True, layers=(0,)))
    cost = ModelCost.from_arch(arch, torch.bfloat16)
    attention, mlp, expert, router = 8 * (8 + 2 * 4) + 8 * 8, 3 * 8 * 16, 3 * 8 * 4, 8 * 8
    # A token multiplies the attention, layer 1's dense MLP, the router and 2 of layer 0's 8 experts.
    assert cost.body_params == 2 * attention + mlp + router + 2 * expert
    assert cost.expert_bytes == 2 * 8 * expert
    assert cost.weight_bytes == 2 * (2 * attention + mlp + 800) + 4 * router + 2 * 2 * expert
    assert cost.step_weight_bytes(1) == cost.weight_bytes
    # Eight tokens pick 1 - (3/4)^8 of the experts on average; a large step reads them all.
    assert cost.step_weight_bytes(8) == round(cost.weight_bytes + 2 * expert * (8 * (1 - 0.75**8) - 2))
    assert cost.step_weight_bytes(10_000) == pytest.approx(cost.weight_bytes + 2 * expert * 6)


def test_proc_stat_snapshot_and_share():
    snap = quiet.take_snapshot()
    if snap is None:
        pytest.skip("no /proc here")
    assert snap.total >= snap.busy >= 0 and snap.own >= 0
    a = quiet.CpuSnapshot(total=1000, busy=300, own=100)
    b = quiet.CpuSnapshot(total=2000, busy=1000, own=600)
    assert quiet.other_cpu_share(a, b) == pytest.approx(0.2)  # (700 - 500) / 1000
    assert quiet.other_cpu_share(a, a) is None


def test_disturbed_runs_are_repeated_and_reported(monkeypatch):
    shares = iter([0.40, 0.30, 0.02])
    monkeypatch.setattr(quiet, "wait_for_quiet", lambda policy: (0.0, 0.0))
    monkeypatch.setattr(quiet, "other_cpu_share", lambda a, b: next(shares))
    calls = []
    result, report = quiet.run_quietly(lambda: calls.append(1) or len(calls), quiet.QuietPolicy(threshold=0.05, max_repeats=5))
    assert result == 3 and report.attempts == 3
    assert report.describe() == "quiet: yes (2.0% other CPU, repeated 2x)"

    shares = iter([0.40, 0.34, 0.50])
    result, report = quiet.run_quietly(lambda: "x", quiet.QuietPolicy(threshold=0.05, max_repeats=2))
    assert report.attempts == 3 and report.other_share == pytest.approx(0.34)
    assert report.describe() == "disturbed: 34% other CPU, repeated 2x"


def test_table_aligns_columns():
    text = table(["name", "tok/s"], [["a", 1234.5], ["bb", None]])
    lines = text.splitlines()
    assert lines[0].startswith("name") and len({len(line) for line in lines[:2]}) == 1
    assert lines[2].endswith("1,234.5") and lines[3].endswith("-")


def test_bf16_gguf_keeps_metadata_and_values(tmp_path):
    source, target = tmp_path / "q.gguf", tmp_path / "bf16.gguf"
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((4, 64)).astype(np.float32)
    norm = rng.standard_normal(64).astype(np.float32)
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(matrix, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    write_gguf_as(source, target, "BF16")
    before, after = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(target))
    assert after.fields["llama.block_count"].contents() == 1
    assert after.fields["tokenizer.ggml.tokens"].contents() == ["a", "b"]
    assert after.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_BF16
    tensors = {t.name: t for t in after.tensors}
    assert tensors["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    original = {t.name: t for t in before.tensors}["blk.0.ffn_up.weight"]
    want = torch.from_numpy(gguf.quants.dequantize(original.data, original.tensor_type)).bfloat16().float()
    got = gguf.quants.dequantize(tensors["blk.0.ffn_up.weight"].data, gguf.GGMLQuantizationType.BF16)
    assert torch.equal(torch.from_numpy(np.asarray(got, dtype=np.float32)).reshape(want.shape), want)


def test_q8_0_gguf_is_the_same_weights_requantized(tmp_path):
    from cadenza.bench.peers.llamacpp import file_precision, peer_files
    from cadenza.models.default_model import default_model_path

    source = default_model_path()
    files = dict(peer_files(source, ["file", "Q8_0", "file"], tmp_path))
    assert list(files) == ["Q4_1", "Q8_0"] and files["Q4_1"] == source
    assert file_precision(files["Q8_0"]) == "Q8_0"
    before = {t.name: t for t in gguf.GGUFReader(str(source)).tensors}
    after = {t.name: t for t in gguf.GGUFReader(str(files["Q8_0"])).tensors}
    assert before.keys() == after.keys()
    original = before["blk.3.ffn_up.weight"]
    want = gguf.quants.dequantize(original.data, original.tensor_type)
    got = gguf.quants.dequantize(after["blk.3.ffn_up.weight"].data, gguf.GGMLQuantizationType.Q8_0)
    # Q8_0 keeps 8 bits per weight with a scale per 32: within half a step of the block's scale.
    assert np.abs(got - want).max() <= np.abs(want).max() / 127


LLAMACPP_MISSING = why_binaries_missing()


@pytest.mark.skipif(LLAMACPP_MISSING is not None, reason=LLAMACPP_MISSING or "")
def test_llamacpp_binaries_measure_the_default_file():
    from cadenza.bench.peers.llamacpp_binaries import LlamaBinaryProbe
    from cadenza.models.default_model import default_model_path

    probe = LlamaBinaryProbe(default_model_path(), "Q4_1", num_threads=2)
    assert probe.name == "llama.cpp Q4_1"
    assert 0 < probe.prefill_seconds(16, seed=1) < 60
    assert probe.decode_tokens_per_second(1, 8, 4, seed=1) > 0
    assert probe.decode_tokens_per_second(2, 8, 4, seed=1) > 0


@pytest.mark.skipif(LLAMACPP_MISSING is not None, reason=LLAMACPP_MISSING or "")
def test_llama_server_runs_the_workload_and_is_stopped():
    from cadenza.bench.peers.llamacpp_server import LlamaServerEngine
    from cadenza.models.default_model import default_model_path

    workload = make_workload(3, (4, 12), (2, 5), seed=0, vocab_size=49152)
    engine = LlamaServerEngine(default_model_path(), "Q4_1", num_threads=2, parallel=2, max_len=32)
    run = engine.run(workload)
    assert run.num_output_tokens == workload.num_output_tokens  # every request ran to its length, EOS ignored
    assert run.engine == "llama.cpp Q4_1 (llama-server, 2 parallel)"
    with pytest.raises(ProcessLookupError):  # stopped, and reaped
        os.kill(engine.last_pid, 0)


def test_spread_runs_each_process_fresh(tmp_path, capsys):
    """`bench spread`: each of cadenza's rates comes from a process of its own (its own threads'
    ticks), beside llama-bench's on the same file when llama.cpp is built."""
    out = tmp_path / "spread.json"
    peer = [] if LLAMACPP_MISSING is None else ["--compare"]  # `--compare` alone: no peer
    code = main(["spread", "--processes", "2", "--decode-prompt-len", "4", "--decode-tokens", "3", "--repeats", "1",
                 "--num-threads", "1", "--no-quiet-check", "--json", str(out), *peer])
    assert code == 0
    result = json.loads(out.read_text())
    ours = result["engines"][0]
    assert ours["engine"] == "cadenza" and ours["processes"] + ours["disturbed"] == 2 and len(ours["rates"]) == 2
    assert ours["min"] <= ours["median"] <= ours["max"] and ours["min"] > 0
    for detail in ours["details"]:
        assert len(detail["rates"]) == 1 and detail["busiest_threads"][0]["ticks"] >= 0
        assert detail["weights_read_gbps"] > 0 and detail["fresh_read_gbps"] > 0  # where the weights sit, read back
        assert detail["load_resident_mib"] > 0.5 * detail["file_mib"]  # the weights, resident once loaded
    assert ("min tok/s" in capsys.readouterr().out)
    if LLAMACPP_MISSING is None:
        assert result["engines"][1]["engine"] == "llama.cpp Q4_1" and len(result["engines"][1]["rates"]) == 2
    else:
        assert len(result["engines"]) == 1


@pytest.mark.parametrize("argv, error", [
    (["--quant", "Q4_K_M"], "--quant and --shape-layers describe a --shape's GGUF; give --shape too"),
    (["--shape-layers", "4"], "--quant and --shape-layers describe a --shape's GGUF; give --shape too"),
    (["--shape", "llama-3.2-1b", "--model", "x.gguf"], "give --model or --shape, not both"),
    (["--shape", "llama-9b"], "--shape 'llama-9b' is not a shipped shape; shipped shapes: gemma-3-1b, gpt-oss-20b"),
    (["--shape", "llama-3.2-1b", "--load-format", "dummy"], "with --load-format dummy give the shape as --model"),
])
def test_shape_flags_are_checked_before_anything_is_written(argv, error, capsys):
    assert main(["latency", *argv, *TINY_LATENCY]) == 2
    assert error in capsys.readouterr().err


def test_step_rows_times_each_chunk_size(tiny_model_dir, capsys):
    from cadenza.bench.features import step_rows

    assert step_rows.main(["--model", str(tiny_model_dir("llama3")), "--sizes", "1", "3", "--context", "20", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "context 20 tokens" in out and "1: " in out and "3: " in out and "(1.00x)" in out


# --- the bench's own layout ---------------------------------------------------------------------

# Each part of bench/ and the parts it may import (bench/__init__.py's list, bottom to top); the
# command line (bench/cli.py) may import any of them, and none may import it. gpu_first_run.py sits
# beside the command line, above the parts: it runs the command line's benches.
TOP = ("cli.py", "gpu_first_run.py")
BENCH_PARTS = {"common": set(), "peers": {"common"}, "offline": {"common", "peers"}, "features": {"common", "offline"},
               "profiling": {"common", "offline"}, "serving": {"common"}, "cpu": {"common", "peers"}}


def test_each_part_of_the_bench_imports_only_the_parts_below_it():
    import ast
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "bench"
    assert {p.name for p in bench.iterdir() if (p / "__init__.py").exists()} == BENCH_PARTS.keys()
    assert {p.name for p in bench.glob("*.py")} == {"__init__.py", *TOP}, "a bench module belongs in a part"
    problems = []
    for path in bench.rglob("*.py"):
        part = path.relative_to(bench).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):  # lazy imports inside functions count too
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cadenza.bench"):
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                target = name.split(".")[2:3]
                if not target or not name.startswith("cadenza.bench") or part in TOP or target[0] == part:
                    continue
                if target[0] == "cli" or target[0] not in BENCH_PARTS[part]:
                    problems.append(f"{path.relative_to(bench)}:{node.lineno} imports {name}")
    assert problems == []


@pytest.mark.parametrize("shape", ["smollm2-135m", "gpt-oss-20b"])
def test_a_shape_written_as_gguf_loads_and_generates(tmp_path, shape):
    """bench/peers/gguf_shapes.py: a shape's F16 GGUF with the default model's tokenizer, as the
    real-size benches write it (here a shipped shape cut down to 2 tiny layers; gpt-oss's with its
    biases, sinks, sliding layers and YaRN)."""
    from pathlib import Path

    from cadenza import LLM, SamplingParams
    from cadenza.bench.peers.gguf_shapes import write_shape_gguf

    config = json.loads((Path(__file__).resolve().parent.parent / f"config/shapes/{shape}.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16)  # fmt: skip
    if shape == "gpt-oss-20b":
        config.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, layer_types=config["layer_types"][:2])
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = write_shape_gguf(str(tmp_path / "config.json"), tmp_path / "tiny.gguf")
    assert not (tmp_path / "tiny.gguf.partial").exists()
    names = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    if shape == "gpt-oss-20b":
        assert names["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.F16
        assert names["blk.0.attn_sinks.weight"] == names["blk.0.ffn_gate_exps.bias"] == gguf.GGMLQuantizationType.F32
    else:
        assert names["blk.1.ffn_down.weight"] == gguf.GGMLQuantizationType.F16 and "output.weight" not in names  # tied
    with LLM(str(path), dtype="float32", **{"logging.level": "warning"}) as llm:
        arch = llm.runtime.loaded.arch
        assert arch.num_layers == 2 and arch.vocab_size == 49152
        if shape == "gpt-oss-20b":
            assert arch.layer_windows == (8, None) and arch.attention_sinks and arch.rope.rope_type == "yarn"
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_gpu_first_run_runs_dry_without_cuda(tmp_path, capsys):
    """bench/gpu_first_run.py, the command a lent GPU runs first: without CUDA each stage's GPU
    part is skipped (tests collected, bench command lines parsed, seeded sampling on the CPU), so
    the script cannot rot unnoticed before the GPU comes."""
    import json

    from cadenza.bench import gpu_first_run

    assert gpu_first_run.main(["--dry", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "first_run.json").read_text())
    assert report["dry"] and [s["name"] for s in report["stages"]] == ["cuda_tests", "seeded_sampling", "latency_1b",
                                                                       "throughput_1b"]
    assert all(s["status"] == "dry" for s in report["stages"]), report["stages"]
    assert "| seeded_sampling | dry |" in (tmp_path / "first_run.md").read_text()
