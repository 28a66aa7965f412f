"""`python -m cadenza.bench.cpu.cpu_kinds`: cadenza against llama.cpp on each CPU kind this machine can act as.

For each kind (`CADENZA_CPU`, kernels/cpu/features.py) it runs, in a child process with
`CADENZA_CPU=<kind>`, the latency bench against llama.cpp's own binaries on the GGUF at its own
precision and on a Q8_0 re-write (`cadenza bench latency --compare llamacpp --llamacpp-precisions
file Q8_0`: batch-1 decode, prefill 512, batch-32 decode, best of `--repeats`, each measure under
the bench's quiet-machine check). The kind holds cadenza's kernels and PyTorch's to its
instruction set, and the latency bench finds the kind's llama.cpp binaries, compiled for the same
instruction set (`python -m cadenza.bench.peers.llamacpp_build --kinds <kind>`). So each table is *this
machine restricted to the kind's ISA*: the instructions of that kind of CPU, with this machine's
caches, memory bandwidth and clock, not a measurement of such a CPU.

It prints a markdown table per kind (cadenza, llama.cpp at each precision, the ratios and whether
the targets are met, the CPU model, the commit, the command) and writes them, with every child's
JSON, to `benchmarks/results/cpu-kinds-<time>.json` (or `--json`). Arguments after `--` go to every
latency run as they are.

    python -m cadenza.bench.cpu.cpu_kinds --kinds avx2 avx512-bf16 native
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

from cadenza.bench.peers import llamacpp_build
from cadenza.config import environment
from cadenza.kernels.cpu import features as cpu_features

TARGET_RATIO = 1.3  # issue 26: cadenza at least 1.3x llama.cpp on every measure
RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# What the parent's `import cadenza` set for its own kind (setdefault): a child sets its kind's.
_TORCH_KIND_VARS = cpu_features.TORCH_KIND_VARS


@dataclass(frozen=True, slots=True)
class KindPlan:
    """What each kind runs: the three measures, best of `repeats`, and the quiet check's bounds."""

    prefill_len: int = 512
    batch: int = 32
    decode_prompt_len: int = 32
    decode_tokens: int = 64
    repeats: int = 5
    max_wait: float = 60.0
    max_repeats: int = 2
    extra: tuple[str, ...] = ()  # passed to `cadenza bench latency` as they are


def default_kinds() -> list[str]:
    """Every kind this CPU can stand in for, weakest first, then the CPU as it is."""
    return [*cpu_features.runnable_kinds(), cpu_features.NATIVE]


def kind_environment(kind: str, environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a child acting as `kind`: `CADENZA_CPU` set, its older name and the PyTorch
    variables an earlier kind set removed (the child's `import cadenza` sets them for this kind)."""
    env = {k: v for k, v in environ.items() if k not in (environment.CPU_ISA.name, *_TORCH_KIND_VARS)}
    env[environment.CPU.name] = kind
    return env


def latency_argv(plan: KindPlan, json_out: Path) -> list[str]:
    """The `cadenza bench latency` arguments of one kind's run."""
    return ["bench", "latency", "--compare", "llamacpp", "--llamacpp-precisions", "file", "Q8_0",
            "--prefill-lens", str(plan.prefill_len), "--batch-size", str(plan.batch),
            "--decode-prompt-len", str(plan.decode_prompt_len), "--decode-tokens", str(plan.decode_tokens),
            "--repeats", str(plan.repeats), "--max-wait", str(plan.max_wait), "--max-repeats", str(plan.max_repeats),
            "--no-model-step", *plan.extra, "--json", str(json_out)]


def shown_command(kind: str, argv: Sequence[str]) -> str:
    """How to run one kind's bench by hand (the JSON path left out)."""
    shown = list(argv[:-2]) if argv[-2:-1] == ["--json"] else list(argv)
    return f"{environment.CPU.name}={kind} cadenza {shlex.join(shown)}"


def cpu_model() -> str:
    """The CPU as /proc/cpuinfo names it, with its family, model and stepping (a VM's name is often generic)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    first = text.split("\n\n", 1)[0]
    fields = dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in first.splitlines()))
    ident = " ".join(f"{key.split()[-1]} {fields[key]}" for key in ("cpu family", "model", "stepping") if key in fields)
    return f"{fields.get('model name', 'unknown CPU')} ({fields.get('vendor_id', '?')} {ident}), {os.cpu_count()} CPUs"


# --- the comparison -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Comparison:
    """One measure: cadenza and each llama.cpp precision (tok/s), and the target against `against`."""

    measure: str
    cadenza: float | None
    peers: dict[str, float | None]  # precision -> tok/s, the file's own first
    against: tuple[str, ...]  # the precisions the target compares with (the best of them)
    quiet: bool | None  # every engine's run of this measure was quiet

    def ratio(self, precision: str) -> float | None:
        peer = self.peers.get(precision)
        return None if self.cadenza is None or not peer else self.cadenza / peer

    @property
    def best_peer(self) -> str | None:
        measured = [p for p in self.against if self.peers.get(p)]
        return max(measured, key=lambda p: self.peers[p]) if measured else None

    @property
    def met(self) -> bool | None:
        best = self.best_peer
        ratio = None if best is None else self.ratio(best)
        return None if ratio is None else ratio >= TARGET_RATIO


def compare(rows: Sequence[Mapping], file_precision: str, plan: KindPlan) -> list[Comparison]:
    """The latency bench's rows (its JSON) as the three comparisons: batch-1 decode against the
    file's own precision, prefill and batch-B decode against the better precision."""
    engines = dict.fromkeys(r["engine"] for r in rows)
    peers = [e.removeprefix("llama.cpp ") for e in engines if e.startswith("llama.cpp ")]
    peers.sort(key=lambda p: p != file_precision)
    measures = [(f"decode, batch 1, ctx {plan.decode_prompt_len}+{plan.decode_tokens}", (file_precision,)),
                (f"prefill {plan.prefill_len}", tuple(peers)),
                (f"decode, batch {plan.batch}, ctx {plan.decode_prompt_len}+{plan.decode_tokens}", tuple(peers))]
    comparisons = []
    for measure, against in measures:
        rates = {r["engine"]: r["tokens_per_s"] for r in rows if r["measure"] == measure}
        quiet = [(r.get("quiet") or {}).get("quiet") for r in rows if r["measure"] == measure]
        comparisons.append(Comparison(
            measure=measure.split(", ctx")[0], cadenza=rates.get("cadenza"),
            peers={p: rates.get(f"llama.cpp {p}") for p in peers}, against=against,
            quiet=None if not quiet or None in quiet else all(quiet)))
    return comparisons


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def render_kind(kind: str, comparisons: Sequence[Comparison], *, cpu: str, revision: str | None, command: str,
                isa: str) -> str:
    """One kind's markdown: a heading saying what stood in for what, then the table and its provenance."""
    peers = list(comparisons[0].peers) if comparisons else []
    header = ["measure", "cadenza", *(f"llama.cpp {p}" for p in peers), *(f"cadenza / {p}" for p in peers),
              "target", "met", "quiet"]
    what = "this machine as it is" if kind == cpu_features.NATIVE else "this machine restricted to the kind's ISA"
    lines = [f"#### {kind}: {what} ({environment.CPU.name}={kind})", "",
             f"CPU: {cpu}; cadenza {revision or 'unknown commit'}; llama.cpp {llamacpp_build.VERSION} "
             f"(llama-cpp-python's source) built for the same ISA: {isa}.", "", f"    {command}", "",
             "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for c in comparisons:
        target = f">= {TARGET_RATIO}x " + (c.against[0] if len(c.against) == 1 else f"best of {', '.join(c.against)}")
        if len(c.against) > 1 and c.best_peer:
            target += f" ({c.best_peer})"
        met = {True: "**yes**", False: "no", None: "-"}[c.met]
        quiet = {True: "yes", False: "**disturbed**", None: "unknown"}[c.quiet]
        cells = [c.measure, _rate(c.cadenza), *(_rate(c.peers[p]) for p in peers),
                 *(_ratio(c.ratio(p)) for p in peers), target, met, quiet]
        lines.append("| " + " | ".join(cells) + " |")
    if any(c.quiet is not True for c in comparisons):
        lines += ["", "Not every run was quiet: these figures are not a measurement to quote."]
    return "\n".join(lines)


def isa_options(kind: str) -> str:
    """The ggml SIMD options llama.cpp is built with for `kind` (those ON), for the table's label."""
    options = llamacpp_build.cpu_options(llamacpp_build.kind_flags(kind))
    on = [o.removeprefix("-DGGML_").removesuffix("=ON") for o in options if o.endswith("=ON")]
    return " ".join(on) + ", AMX off"


# --- running --------------------------------------------------------------------------------------


def run_kind(kind: str, plan: KindPlan, python: str = sys.executable) -> dict:
    """One kind's latency bench in a child process; its record (skipped with the reason when it cannot run)."""
    record: dict = {"kind": kind, "llamacpp_bin": None}
    try:
        record["isa"] = isa_options(kind)
    except ValueError as exc:
        return record | {"status": "skipped", "reason": str(exc)}
    why = llamacpp_build.why_binaries_missing(kind)
    if why:
        return record | {"status": "skipped", "reason": why}
    record["llamacpp_bin"] = str(llamacpp_build.bin_dir(kind))
    with tempfile.TemporaryDirectory(prefix="cpu-kinds-") as tmp:
        json_out = Path(tmp) / "latency.json"
        argv = latency_argv(plan, json_out)
        record["command"] = shown_command(kind, argv)
        print(f"\n== {kind}: {record['command']}", flush=True)
        done = subprocess.run([python, "-m", "cadenza", *argv], env=kind_environment(kind, os.environ))
        if done.returncode != 0 or not json_out.is_file():
            return record | {"status": "failed", "reason": f"cadenza bench latency exited {done.returncode}"}
        record["latency"] = json.loads(json_out.read_text())
    return record | {"status": "ok"}


def comparisons_of(record: dict, plan: KindPlan) -> list[Comparison]:
    """A finished kind's comparisons, from its latency JSON (the file's precision read from the GGUF)."""
    from cadenza.bench.peers.llamacpp import file_precision

    latency = record["latency"]
    model = Path(latency["model"])
    return compare(latency["rows"], file_precision(model) if model.suffix == ".gguf" else "file", plan)


def summarize(record: dict, comparisons: Sequence[Comparison], cpu: str) -> str:
    """The markdown for one kind's record (a line saying why, when it did not run)."""
    kind = record["kind"]
    if record["status"] != "ok":
        return f"#### {kind}: {record['status']}: {record['reason']}"
    latency = record["latency"]
    text = render_kind(kind, comparisons, cpu=cpu, revision=latency["environment"].get("cadenza_revision"),
                       command=record["command"], isa=record["isa"])
    return text + "".join(f"\n\n{name}: {why}" for name, why in latency.get("skipped", {}).items())


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    own, extra = (raw[:raw.index("--")], raw[raw.index("--") + 1:]) if "--" in raw else (raw, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=[cpu_features.NATIVE, *cpu_features.CPU_KINDS], metavar="KIND",
                        help="CPU kinds to run as (default: every kind this CPU can act as, then native)")
    defaults = KindPlan()
    parser.add_argument("--prefill-len", type=int, default=defaults.prefill_len)
    parser.add_argument("--batch-size", type=int, default=defaults.batch)
    parser.add_argument("--decode-prompt-len", type=int, default=defaults.decode_prompt_len)
    parser.add_argument("--decode-tokens", type=int, default=defaults.decode_tokens)
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="best of this many per measurement")
    parser.add_argument("--max-wait", type=float, default=defaults.max_wait,
                        help="seconds to wait for a busy machine before each run (the latency bench's)")
    parser.add_argument("--max-repeats", type=int, default=defaults.max_repeats, help="repeats of a disturbed run")
    parser.add_argument("--json", type=Path, help="where the results go (default benchmarks/results/cpu-kinds-<time>.json)")
    args = parser.parse_args(own)
    plan = KindPlan(args.prefill_len, args.batch_size, args.decode_prompt_len, args.decode_tokens, args.repeats,
                    args.max_wait, args.max_repeats, tuple(extra))
    cpu = cpu_model()
    command = shlex.join(["python", "-m", "cadenza.bench.cpu.cpu_kinds", *raw])
    records = [run_kind(kind, plan) for kind in dict.fromkeys(args.kinds or default_kinds())]
    sections = []
    for record in records:
        comparisons = comparisons_of(record, plan) if record["status"] == "ok" else []
        record["comparisons"] = [asdict(c) | {"best_peer": c.best_peer, "met": c.met} for c in comparisons]
        sections.append(summarize(record, comparisons, cpu))
    print(f"\n### Per CPU kind ({cpu})\n\n    {command}\n")
    print("\n\n".join(sections))
    out = args.json or RESULTS_DIR / f"cpu-kinds-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "cpu-kinds", "command": command, "cpu": cpu, "target_ratio": TARGET_RATIO,
                               "plan": asdict(plan), "kinds": records, "markdown": sections},
                              indent=2, default=str) + "\n")
    print(f"\nwrote {out}")
    return 0 if all(r["status"] != "failed" for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
