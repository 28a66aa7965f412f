"""llama.cpp per CPU kind and the per-kind runner: paths, build options, the build's steps and the
tables, without compiling or running llama.cpp (its commands are recorded, its outputs faked)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cadenza.bench.cpu import cpu_kinds
from cadenza.bench.cpu.cpu_kinds import Comparison, KindPlan, compare, render_kind
from cadenza.bench.peers import llamacpp_build
from cadenza.config import environment
from cadenza.kernels.cpu import features as cpu_features

# What /proc/cpuinfo lists on a Sapphire Rapids (the SIMD part), and what each kind keeps of it.
SPR = frozenset({"sse4_2", "f16c", "fma", "bmi2", "avx", "avx2", "avx_vnni", "avx512f", "avx512cd", "avx512dq",
                 "avx512bw", "avx512vl", "avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"})
AVX2_ONLY = frozenset({"sse4_2", "f16c", "fma", "bmi2", "avx", "avx2"})
AVX512_BF16_KIND = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}  # no cd/dq: hidden


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(environment.LLAMACPP_HOME.name, str(tmp_path / "llama.cpp"))
    monkeypatch.delenv(environment.CPU_ISA.name, raising=False)
    monkeypatch.delenv(environment.CPU.name, raising=False)
    return tmp_path / "llama.cpp" / llamacpp_build.VERSION


def make_binaries(where: Path, names=(*llamacpp_build.TARGETS, llamacpp_build.CPU_BACKEND)) -> None:
    where.mkdir(parents=True, exist_ok=True)
    for name in names:
        (where / name).write_text("#!/bin/sh\n")
        (where / name).chmod(0o755)


def options(flags) -> dict[str, str]:
    return dict(o.removeprefix("-D").split("=") for o in llamacpp_build.cpu_options(frozenset(flags)))


# --- where each kind's binaries are ---------------------------------------------------------------


def test_each_kind_has_its_own_bin_dir(cache, monkeypatch):
    assert llamacpp_build.bin_dir("avx2") == cache / "avx2" / "bin"
    assert llamacpp_build.bin_dir() == cache / "native" / "bin"  # CADENZA_CPU unset
    kind = cpu_features.runnable_kinds()[:1] or pytest.skip("this CPU stands in for no kind")
    monkeypatch.setenv(environment.CPU.name, kind[0])
    assert llamacpp_build.bin_dir() == cache / kind[0] / "bin"  # what the benches find under CADENZA_CPU


def test_a_kind_finds_only_its_own_binaries(cache):
    make_binaries(cache / "native" / "bin")
    assert llamacpp_build.why_binaries_missing("native") is None
    assert llamacpp_build.find_binary("llama-bench", "native") == cache / "native" / "bin" / "llama-bench"
    assert llamacpp_build.find_binary("llama-bench", "avx2") is None
    why = llamacpp_build.why_binaries_missing("avx2")
    assert "CPU kind avx2" in why and "python -m cadenza.bench.peers.llamacpp_build --kinds avx2" in why


def test_the_cpu_backend_counts_as_a_binary(cache):
    make_binaries(cache / "avx2" / "bin", llamacpp_build.TARGETS)
    assert llamacpp_build.CPU_BACKEND in llamacpp_build.why_binaries_missing("avx2")


def test_an_impossible_kind_is_a_reason_not_a_crash(cache, monkeypatch):
    monkeypatch.setenv(environment.CPU.name, "sse2")
    assert "no llama.cpp for this CPU kind" in llamacpp_build.why_binaries_missing()


# --- the build options of each kind ---------------------------------------------------------------


def test_avx2_kind_compiles_no_avx512():
    got = options(AVX2_ONLY)
    assert got["GGML_NATIVE"] == "OFF" and got["GGML_AVX2"] == got["GGML_FMA"] == got["GGML_F16C"] == "ON"
    assert {k for k, v in got.items() if v == "ON"} == {"GGML_SSE42", "GGML_F16C", "GGML_FMA", "GGML_BMI2", "GGML_AVX",
                                                        "GGML_AVX2"}


def test_avx512_bf16_kind_compiles_avx512_though_the_kind_hides_cd_and_dq():
    got = options(AVX512_BF16_KIND)
    assert got["GGML_AVX512"] == got["GGML_AVX512_VNNI"] == got["GGML_AVX512_BF16"] == "ON"
    assert got["GGML_AVX512_VBMI"] == got["GGML_AVX_VNNI"] == "OFF"  # the kind does not name them


def test_amx_stays_off_even_where_the_cpu_has_it():
    got = options(SPR)
    assert got["GGML_AMX_TILE"] == got["GGML_AMX_INT8"] == got["GGML_AMX_BF16"] == "OFF"
    assert got["GGML_AVX512_VBMI"] == got["GGML_AVX_VNNI"] == "ON"


def test_without_avx2_ggml_picks_for_itself():
    assert llamacpp_build.cpu_options(frozenset()) == ["-DGGML_NATIVE=ON"]


def test_a_kinds_options_come_from_its_flags_on_this_cpu(monkeypatch):
    monkeypatch.setenv(environment.CPU.name, "native")
    native = cpu_features.native_cpu_flags()
    assert llamacpp_build.kind_flags("native") == native
    if "avx2" in cpu_features.runnable_kinds():
        assert options(llamacpp_build.kind_flags("avx2")).get("GGML_AVX512") == "OFF"
    assert os.environ[environment.CPU.name] == "native"  # acting as a kind is undone


# --- the build's steps: one kind-independent build, a CPU backend per kind -------------------------


def test_build_compiles_the_base_once_and_a_cpu_backend_per_kind(cache, monkeypatch, tmp_path):
    commands: list[list[str]] = []

    def fake_run(command):
        commands.append(command)
        if command[:2] == ["cmake", "--build"]:
            out = Path(command[2]) / "bin"
            if "ggml-cpu" in command:
                make_binaries(out, [llamacpp_build.CPU_BACKEND])
            else:
                make_binaries(out, [*llamacpp_build.TARGETS, "libllama.so.0", "libggml-base.so.0"])
                if not (out / "libllama.so").is_symlink():  # cmake re-runs the base build as a no-op
                    (out / "libllama.so").symlink_to("libllama.so.0")

    monkeypatch.setattr(llamacpp_build, "_run", fake_run)
    monkeypatch.setattr(llamacpp_build, "_source", lambda work: tmp_path / "source")
    monkeypatch.setattr(llamacpp_build.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(llamacpp_build, "kind_flags", lambda kind: AVX2_ONLY if kind == "avx2" else SPR)

    assert llamacpp_build.build("avx2", jobs=2) == cache / "avx2" / "bin"
    configures = [c for c in commands if c[1] == "-S"]
    assert "-DGGML_CPU=OFF" in configures[0] and "-DGGML_BACKEND_DL=ON" in configures[0]
    assert "-DGGML_AVX2=ON" in configures[1] and "-DGGML_AVX512=OFF" in configures[1]
    builds = [c for c in commands if c[1] == "--build"]
    assert builds[0][-len(llamacpp_build.TARGETS):] == list(llamacpp_build.TARGETS) and builds[1][-1] == "ggml-cpu"
    avx2 = cache / "avx2" / "bin"
    assert {p.name for p in avx2.iterdir()} >= {*llamacpp_build.TARGETS, "libllama.so", "libllama.so.0",
                                                 "libggml-base.so.0", llamacpp_build.CPU_BACKEND}
    assert (avx2 / "libllama.so").is_symlink()
    assert llamacpp_build.why_binaries_missing("avx2") is None

    commands.clear()
    llamacpp_build.build("native", jobs=2)
    assert "-DGGML_AVX512=ON" in [c for c in commands if c[1] == "-S"][1]
    assert llamacpp_build.why_binaries_missing("native") is None
    commands.clear()
    llamacpp_build.build("avx2")  # built: nothing runs
    assert commands == []


def test_the_build_cli_names_the_missing_kind(cache, capsys):
    assert llamacpp_build.main(["--where", "--kinds", "avx2"]) == 1
    assert "--kinds avx2" in capsys.readouterr().err
    make_binaries(cache / "avx2" / "bin")
    assert llamacpp_build.main(["--where", "--kinds", "avx2"]) == 0
    assert capsys.readouterr().out.strip() == str(cache / "avx2" / "bin")


# --- the runner's pure parts ----------------------------------------------------------------------


def test_a_kinds_environment_names_it_and_drops_an_earlier_kinds_torch_settings():
    env = cpu_kinds.kind_environment("avx2", {"PATH": "/bin", environment.CPU.name: "native",
                                               environment.CPU_ISA.name: "avx512vnni",
                                               "ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
    assert env == {"PATH": "/bin", environment.CPU.name: "avx2"}


def test_the_latency_command_and_how_it_is_shown():
    argv = cpu_kinds.latency_argv(KindPlan(repeats=3, extra=("--num-threads", "2")), Path("/tmp/x.json"))
    joined = " ".join(argv)
    assert joined.startswith("bench latency --compare llamacpp --llamacpp-precisions file Q8_0 --prefill-lens 512 "
                             "--batch-size 32")
    assert "--repeats 3" in joined and "--num-threads 2" in joined and argv[-2:] == ["--json", "/tmp/x.json"]
    shown = cpu_kinds.shown_command("avx2", argv)
    assert shown.startswith("CADENZA_CPU=avx2 cadenza bench latency ") and "--json" not in shown


def row(measure: str, engine: str, rate: float | None, quiet: bool = True) -> dict:
    return {"measure": measure, "engine": engine, "tokens_per_s": rate, "quiet": {"quiet": quiet}}


ROWS = [
    row("decode, batch 1, ctx 32+64", "cadenza", 300.0), row("prefill 512", "cadenza", 2000.0),
    row("decode, batch 32, ctx 32+64", "cadenza", 900.0),
    row("decode, batch 1, ctx 32+64", "llama.cpp Q8_0", 280.0), row("prefill 512", "llama.cpp Q8_0", 1600.0),
    row("decode, batch 32, ctx 32+64", "llama.cpp Q8_0", 800.0, quiet=False),
    row("decode, batch 1, ctx 32+64", "llama.cpp Q4_1", 200.0), row("prefill 512", "llama.cpp Q4_1", 1000.0),
    row("decode, batch 32, ctx 32+64", "llama.cpp Q4_1", 500.0),
]


def test_batch_1_compares_with_the_files_precision_and_the_rest_with_the_best():
    decode_1, prefill, decode_32 = compare(ROWS, "Q4_1", KindPlan())
    assert list(decode_1.peers) == ["Q4_1", "Q8_0"]  # the file's own first
    assert decode_1.against == ("Q4_1",) and decode_1.ratio("Q4_1") == 1.5 and decode_1.met is True
    assert prefill.best_peer == "Q8_0" and prefill.ratio("Q8_0") == 1.25 and prefill.met is False
    assert decode_32.best_peer == "Q8_0" and decode_32.quiet is False and decode_1.quiet is True


def test_a_missing_peer_makes_the_target_unknown():
    c = Comparison("prefill 512", None, {"Q4_1": 10.0}, ("Q4_1",), None)
    assert c.ratio("Q4_1") is None and c.met is None
    assert Comparison("prefill 512", 10.0, {"Q4_1": None}, ("Q4_1",), True).best_peer is None


def test_the_table_says_what_stood_in_for_what():
    text = render_kind("avx2", compare(ROWS, "Q4_1", KindPlan()), cpu="Intel(R) Xeon(R) Processor, 2 CPUs",
                       revision="abc1234", command="CADENZA_CPU=avx2 cadenza bench latency ...", isa="AVX2 FMA, AMX off")
    lines = text.splitlines()
    assert lines[0] == "#### avx2: this machine restricted to the kind's ISA (CADENZA_CPU=avx2)"
    assert "Intel(R) Xeon(R) Processor" in text and "abc1234" in text and "AVX2 FMA, AMX off" in text
    assert "    CADENZA_CPU=avx2 cadenza bench latency ..." in lines
    assert ("| measure | cadenza | llama.cpp Q4_1 | llama.cpp Q8_0 | cadenza / Q4_1 | cadenza / Q8_0 | target | met "
            "| quiet |") in lines
    assert "| decode, batch 1 | 300.0 | 200.0 | 280.0 | 1.50x | 1.07x | >= 1.3x Q4_1 | **yes** | yes |" in lines
    assert "| prefill 512 | 2,000.0 | 1,000.0 | 1,600.0 | 2.00x | 1.25x | >= 1.3x best of Q4_1, Q8_0 (Q8_0) | no | yes |" in lines
    assert lines[-1] == "Not every run was quiet: these figures are not a measurement to quote."


def test_the_runner_writes_a_table_per_kind_and_the_json(monkeypatch, tmp_path, capsys):
    def fake_run_kind(kind, plan):
        if kind == "avx2":
            return {"kind": kind, "status": "skipped", "reason": "not built", "llamacpp_bin": None}
        return {"kind": kind, "status": "ok", "isa": "AVX2", "llamacpp_bin": "/x", "command": f"CADENZA_CPU={kind} ...",
                "latency": {"model": "m.gguf", "rows": ROWS, "environment": {"cadenza_revision": "abc1234"},
                            "skipped": {}}}

    monkeypatch.setattr(cpu_kinds, "run_kind", fake_run_kind)
    monkeypatch.setattr("cadenza.bench.peers.llamacpp.file_precision", lambda path: "Q4_1")
    out = tmp_path / "kinds.json"
    assert cpu_kinds.main(["--kinds", "avx2", "native", "--json", str(out), "--", "--num-threads", "2"]) == 0
    printed = capsys.readouterr().out
    assert "#### avx2: skipped: not built" in printed and "#### native: this machine as it is (CADENZA_CPU=native)" in printed
    assert "python -m cadenza.bench.cpu.cpu_kinds --kinds avx2 native --json" in printed
    saved = json.loads(out.read_text())
    assert saved["plan"]["extra"] == ["--num-threads", "2"] and saved["target_ratio"] == 1.3
    native = saved["kinds"][1]
    assert [c["met"] for c in native["comparisons"]] == [True, False, False]
    assert len(saved["markdown"]) == 2


def test_kernel_rates_time_every_type_in_both_layouts():
    from cadenza.bench.cpu.kernel_rates import TYPES, measure, report
    from cadenza.kernels.cpu import loader

    kernels = loader.configure("auto")
    if kernels is None:
        pytest.skip("the CPU kernels are not built here")
    result = measure(kernels, (32, 512), [1, 3], read_bytes=4 << 20)
    assert set(result["rates"]) == set(TYPES) and result["read_rate"] > 0
    for name, layouts in result["rates"].items():
        assert set(layouts) == {"file", "packed"}, name  # every type the kernels read packs on every build
        assert all(rate > 0 for by_rows in layouts.values() for rate in by_rows.values())
    assert "IQ4_XS   packed" in report(result, [1, 3])
