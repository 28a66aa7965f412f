"""The wheel is the product: built from this tree, it holds every module and every data file the
code reads at run time (the playground page, the kernels' source, presets, model shapes), and the
build warns of nothing left out."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Data files read at run time, by where they live in the tree.
DATA = ["static/*.html", "kernels/cpu/*.cpp", "kernels/cpu/*.h", "config/presets/*.yaml", "config/shapes/*.json", "kernels/cuda/*.cu"]
NOT_PACKAGED = {"tests", "examples", "benchmarks", "build", "docs", ".venv", ".ci", ".git"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[set[str], str]:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("cadenza-*.whl")
    with zipfile.ZipFile(path) as z:
        return set(z.namelist()), done.stdout + done.stderr


def test_every_module_is_in_the_wheel(wheel):
    names, _ = wheel
    modules = {
        f"cadenza/{p.relative_to(ROOT).as_posix()}"
        for p in ROOT.rglob("*.py")
        if p.relative_to(ROOT).parts[0] not in NOT_PACKAGED and "site-packages" not in p.parts
    }
    assert modules, "found no module"
    assert not sorted(modules - names)


def test_every_data_file_is_in_the_wheel(wheel):
    names, _ = wheel
    data = {f"cadenza/{p.relative_to(ROOT).as_posix()}" for pattern in DATA for p in ROOT.glob(pattern)}
    assert "cadenza/static/index.html" in data and "cadenza/kernels/cpu/cpu_kernels.cpp" in data
    assert not sorted(data - names)


def test_the_build_leaves_nothing_out(wheel):
    _, log = wheel
    for warning in ("would be ignored", "is absent from the `packages` configuration"):
        assert warning not in log, log[log.find(warning) - 500 : log.find(warning) + 200]
