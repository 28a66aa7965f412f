"""`python -m cadenza.bench.gpu_first_run [--out DIR]`: what the first GPU at hand runs, in one go.

Beside cli.py, above the bench's parts: it runs the bench's own commands (and the tests), nothing of
its own to measure.

GPU time comes in windows of minutes, so this runs everything worth knowing from one, within a
budget (7 minutes on an H100 by default), each stage with its own time limit, a stage that fails
or times out recorded and the next one run:

1. `cuda_tests`: the tests whose CUDA parts only a GPU runs (Triton kernels natively, CUDA graphs,
   cupy ops, the grouped-GEMM mixture, the bench's CUDA paths);
2. `seeded_sampling`: seeded and unseeded requests batched together on the device: none fails and
   the same seed gives the same tokens (issue 36's first bug);
3. `latency_1b`: `cadenza bench latency` on the Llama-3.2-1B shape, random weights, batch 1 and 256;
4. `throughput_1b`: `cadenza bench throughput` with nano-vllm's workload on the same shape.

It writes `first_run.json` and `first_run.md` (a table of the stages) into --out (default: $OUT,
the device tool's folder that comes back, else ./gpu-first-run), and the benches' own JSON beside
them. Without CUDA it runs dry, so CI keeps it from rotting: the tests are only collected, the
benches' command lines only parsed, and the sampling stage runs on the CPU.

    python -m cadenza.bench.gpu_first_run            # on the GPU machine, from the repository root
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

CUDA_TESTS = ("tests/test_triton_ops.py", "tests/test_cupy_ops.py", "tests/test_decode_graphs.py",
              "tests/test_grouped_moe.py", "tests/test_bench_cuda_paths.py")
SHAPE = "llama-3.2-1b"


@dataclass
class StageResult:
    name: str
    status: str  # "ok", "failed", "timed out", "dry"
    seconds: float
    summary: str
    details: dict = field(default_factory=dict)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _run(command: list[str], timeout: float) -> tuple[str, str]:
    """(status, the output's last lines) of a subprocess given `timeout` seconds."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:]
        return "timed out", tail.decode(errors="replace") if isinstance(tail, bytes) else tail
    text = (done.stdout + done.stderr).strip()
    return ("ok" if done.returncode == 0 else "failed"), "\n".join(text.splitlines()[-15:])


def cuda_tests(out: Path, dry: bool, timeout: float) -> StageResult:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS]
    started = time.monotonic()
    status, tail = _run([*command, "--collect-only"] if dry else command, timeout)
    summary = tail.splitlines()[-1] if tail else ""
    return StageResult("cuda_tests", "dry" if dry and status == "ok" else status, time.monotonic() - started, summary,
                       {"command": " ".join(command), "tail": tail})


def seeded_sampling(out: Path, dry: bool, timeout: float) -> StageResult:
    """Two seeded requests (the same seed) batched with an unseeded one, then the seeded again
    alone: every request finishes, and the same seed gives the same tokens."""
    from cadenza import LLM, SamplingParams

    started = time.monotonic()
    device = "cpu" if dry else "cuda"
    with LLM("smollm2-135m", load_format="dummy", device=device, dtype="float32" if dry else "bfloat16",
             max_model_len=256, **{"logging.level": "warning"}) as llm:  # fmt: skip
        seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
        plain = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
        prompts = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8]]
        together = llm.generate(prompts, [seeded, plain, seeded], use_tqdm=False)
        (alone,) = llm.generate([prompts[0]], seeded, use_tqdm=False)
    completions = [o.outputs[0] for o in together]
    failed = [c.error for c in completions if c.finish_reason == "error"]
    same = completions[0].token_ids == completions[2].token_ids == alone.outputs[0].token_ids
    status = "ok" if not failed and same else "failed"
    summary = f"{len(failed)} of 3 failed; the same seed gave the same tokens: {same}"
    return StageResult("seeded_sampling", "dry" if dry and status == "ok" else status, time.monotonic() - started,
                       summary, {"device": device, "errors": failed})


def _bench(name: str, arguments: list[str], out: Path, dry: bool, timeout: float) -> StageResult:
    from cadenza.bench.cli import add_bench_parser

    json_path = out / f"{name}.json"
    arguments = [*arguments, "--json", str(json_path)]
    parser = argparse.ArgumentParser(prog="cadenza")
    add_bench_parser(parser.add_subparsers(dest="command"))
    parser.parse_args(["bench", *arguments])  # the command line stays valid, dry or not
    command = [sys.executable, "-m", "cadenza.bench.cli", *arguments]
    if dry:
        return StageResult(name, "dry", 0.0, "command line parsed", {"command": " ".join(command)})
    started = time.monotonic()
    status, tail = _run(command, timeout)
    details = {"command": " ".join(command), "tail": tail}
    if json_path.is_file():
        details["json"] = json_path.name
    return StageResult(name, status, time.monotonic() - started, tail.splitlines()[-1] if tail else "", details)


def latency(out: Path, dry: bool, timeout: float) -> StageResult:
    return _bench("latency_1b", ["latency", "--device", "cuda", "--load-format", "dummy", "--model", SHAPE,
                                 "--batch-size", "256", "--max-model-len", "2048", "--no-quiet-check"], out, dry, timeout)


def throughput(out: Path, dry: bool, timeout: float) -> StageResult:
    return _bench("throughput_1b", ["throughput", "--device", "cuda", "--load-format", "dummy", "--model", SHAPE,
                                    "--workload", "nano-vllm", "--max-model-len", "2048", "--no-quiet-check"],
                  out, dry, timeout)


# (stage, its share of the budget): the tests first, the longest benches last.
STAGES = ((cuda_tests, 0.30), (seeded_sampling, 0.10), (latency, 0.30), (throughput, 0.30))


def table(results: list[StageResult]) -> str:
    rows = ["| stage | status | seconds | summary |", "|---|---|---|---|"]
    rows += [f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.summary.replace('|', '/')} |" for r in results]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-first-run"))
    parser.add_argument("--budget-seconds", type=float, default=420.0, help="the whole run's time (7 minutes)")
    parser.add_argument("--dry", action="store_true", help="as without CUDA: collect, parse, sample on the CPU")
    args = parser.parse_args(argv)
    dry = args.dry or not _cuda()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for stage, share in STAGES:
        started = time.monotonic()
        try:
            result = stage(args.out, dry, args.budget_seconds * share)
        except Exception as exc:  # a stage that breaks is recorded; the next still runs
            result = StageResult(stage.__name__, "failed", time.monotonic() - started, f"{type(exc).__name__}: {exc}"[:300])
        results.append(result)
        print(f"{result.name}: {result.status} ({result.seconds:.0f} s) {result.summary}", flush=True)
    import torch

    device = torch.cuda.get_device_name(0) if not dry else "none (dry run)"
    (args.out / "first_run.json").write_text(json.dumps({"device": device, "dry": dry,
                                                         "stages": [asdict(r) for r in results]}, indent=2))
    (args.out / "first_run.md").write_text(f"GPU first run on {device}\n\n" + table(results))
    return 0 if all(r.status in ("ok", "dry") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
