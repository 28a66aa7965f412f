"""docs/plugins.md stays true: every hook and contract member has a section, and the tutorial's
plugin (its module, package metadata and unit test, as printed) runs through the engine."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml
from plugin_contracts import contract_members, hookspec_names

from cadenza import LLM, SamplingParams
from cadenza.config import load_config
from cadenza.runtime.registries import ENTRY_POINT_GROUP

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
TEXT = DOCS.read_text()
HEADINGS = [line for line in TEXT.splitlines() if line.startswith("#")]


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", TEXT, re.S)


def tutorial_module() -> str:
    (module,) = [b for b in code_blocks("python") if b.startswith("# cadenza_no_repeat.py")]
    return module


def has_section(name: str) -> bool:
    return any(re.search(rf"`{re.escape(name)}[(:`]", heading) for heading in HEADINGS)


@pytest.mark.parametrize("hook", hookspec_names())
def test_every_hook_has_a_section(hook):
    assert has_section(hook), f"docs/plugins.md has no heading for hook `{hook}(...)`"


@pytest.mark.parametrize("member", contract_members())
def test_every_contract_member_has_a_section(member):
    assert has_section(member), f"docs/plugins.md has no heading for `{member}`"


def test_discovery_is_documented():
    for needle in (f"group **`{ENTRY_POINT_GROUP}`**", "**`plugins:`**", "**`CADENZA_PLUGINS`**", "extra_body={\"extra\": {"):
        assert needle in TEXT


def test_tutorial_package_metadata_has_the_entry_point():
    (pyproject,) = [tomllib.loads(b) for b in code_blocks("toml")]
    assert pyproject["project"]["entry-points"][ENTRY_POINT_GROUP] == {"no_repeat_ngram": "cadenza_no_repeat"}
    assert pyproject["tool"]["setuptools"]["py-modules"] == ["cadenza_no_repeat"]


def test_tutorial_yaml_is_a_valid_deployment(tmp_path):
    for i, block in enumerate(code_blocks("yaml")):
        path = tmp_path / f"snippet{i}.yaml"
        path.write_text(block)
        load_config(path, env={})  # every key exists and every value is well-formed
    assert any("no_repeat_ngram" in yaml.safe_load(b).get("sampling", {}).get("logits_processors", []) for b in code_blocks("yaml"))


@pytest.fixture
def tutorial_plugin(tmp_path, monkeypatch):
    (tmp_path / "cadenza_no_repeat.py").write_text(tutorial_module())
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "cadenza_no_repeat"
    sys.modules.pop("cadenza_no_repeat", None)


def test_tutorial_unit_test_passes_as_printed(tutorial_plugin):
    (snippet,) = [b for b in code_blocks("python") if "from cadenza_no_repeat import" in b]
    exec(compile(snippet, "docs/plugins.md", "exec"), {})


def test_tutorial_plugin_through_the_engine(tutorial_plugin, tiny_model_dir):
    overrides = {
        "model.path": str(tiny_model_dir("llama3")), "model.dtype": "float32", "cache.num_blocks": 128,
        "plugins": [tutorial_plugin], "sampling.logits_processors": ["no_repeat_ngram", "temperature"],
    }  # fmt: skip
    params = dict(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(config=load_config(None, overrides=overrides, env={})) as llm:
        on, off = (o.outputs[0] for o in llm.generate([[5, 6, 5, 6], [5, 6, 5, 6]], [SamplingParams(extra={"no_repeat_ngram": {"n": 2}}, **params), SamplingParams(**params)]))
        alone = llm.generate([[5, 6, 5, 6]], SamplingParams(**params))[0].outputs[0]
        bad = llm.generate([[5]], SamplingParams(extra={"no_repeat_ngram": {"n": 99}}, **params))[0].outputs[0]
    bigrams = list(zip(on.token_ids, on.token_ids[1:]))
    assert len(bigrams) == len(set(bigrams)) == 39
    assert off.token_ids == alone.token_ids
    assert bad.finish_reason == "error" and "extra.no_repeat_ngram.n: Input should be less than or equal to 16" in bad.error
