"""Plain-text tables and the JSON file the bench writes."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any, Sequence

import torch

from cadenza.bench.common.quiet import describe_machine


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def flops(rate: float) -> str:
    """A FLOP/s rate in GFLOP/s, or TFLOP/s from 10 TFLOP/s up (a GPU's)."""
    return f"{rate / 1e12:,.1f} TFLOP/s" if rate >= 1e13 else f"{rate / 1e9:,.1f} GFLOP/s"


def percent(part: float | None, whole: float | None) -> str:
    if part is None or not whole:
        return "-"
    return f"{100 * part / whole:.0f}%"


def source_revision() -> str | None:
    """The cadenza commit measured, `+dirty` when the work tree has changes; None outside a checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[2]  # the checkout: bench/common/ is two folders down
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def environment(num_threads: int | None, device: torch.device | None = None) -> dict[str, Any]:
    from cadenza.bench.common.device import describe_device

    return {
        "cadenza_revision": source_revision(),
        "device": describe_device(device or torch.device("cpu")),
        "machine": describe_machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "requested_threads": num_threads,
    }


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")
