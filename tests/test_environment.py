"""Every environment variable cadenza reads is declared in `config/environment.py`, and setting any of
them never stops the CLI: the config loader reads other `CADENZA_*` variables as config keys."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cadenza import cli
from cadenza.config import environment, load_config
from cadenza.config.loader import _env_respelling

ROOT = Path(environment.__file__).parent
# A `CADENZA_...` name in the source that is not a config key (those have `__` between levels).
_NAME = re.compile(r"\bCADENZA_[A-Z0-9]+(?:_[A-Z0-9]+)*\b")


def _source_files():
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if parts[0] not in ("tests", ".venv", "build", "examples") and "site-packages" not in parts:
            yield path


def test_every_variable_the_code_names_is_declared():
    named = {m.group(0) for path in _source_files() for m in _NAME.finditer(path.read_text())}
    named -= {"CADENZA_"}  # the prefix itself
    assert named, "the scan found no variable at all"
    # Config keys (`CADENZA_SERVER__PORT`, or a misspelling of one that a docstring shows) aside.
    undeclared = sorted(n for n in named if n not in environment.NAMES and "__" not in n and _env_respelling(n) is None)
    assert not undeclared, f"declare these in config/environment.py: {undeclared}"


@pytest.mark.parametrize("var", environment.ALL, ids=lambda v: v.name)
def test_the_config_loader_leaves_each_variable_alone(var):
    assert load_config(None, env={var.name: var.example}) is not None


@pytest.mark.parametrize("var", environment.ALL, ids=lambda v: v.name)
def test_the_cli_runs_with_each_variable_set(var, monkeypatch, capsys):
    monkeypatch.setenv(var.name, var.example)
    assert cli.main(["config", "show"]) == 0
    assert "model:" in capsys.readouterr().out


def test_a_generation_runs_with_every_variable_set_at_once(model_path):
    env = {**os.environ, **{v.name: v.example for v in environment.ALL}}
    env.pop(environment.CPU_ISA.name)  # the older name would contradict CADENZA_CPU if they differed
    env.pop("ATEN_CPU_CAPABILITY", None)
    done = subprocess.run(
        [sys.executable, "-m", "cadenza", "generate", "hello", "--model", str(model_path), "--max-tokens", "3"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_an_unknown_cadenza_variable_is_still_a_config_error():
    with pytest.raises(Exception, match="CADENZA_NOT_A_THING"):
        load_config(None, env={"CADENZA_NOT_A_THING": "1"})
