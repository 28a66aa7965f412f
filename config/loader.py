"""`load_config`: defaults < YAML file < environment < overrides, merged deeply, validated once."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from cadenza.config import environment
from cadenza.config.errors import ConfigError, Loc, find_key, key_path, validation_problems
from cadenza.config.schema import CadenzaConfig, section_model

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

ENV_PREFIX = "CADENZA_"
CONFIG_ENV = environment.CONFIG.name  # names a config file when load_config gets no path
# Never config keys: every variable cadenza reads for itself (the plugin allowlist, the CPU kind, ...).
RESERVED_ENV = environment.NAMES

_FILE, _ENV, _OVERRIDE = 1, 2, 3  # layer ranks: a higher rank wins
# Alternative ways to give one setting: when a higher layer sets one, the lower layers' value for
# the other is dropped, so `--num-blocks` on the command line beats the preset's memory_budget.
_ALTERNATIVES = ((("cache", "num_blocks"), ("cache", "memory_budget")),)


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> CadenzaConfig:
    """The effective config from defaults, a YAML file, `CADENZA_*` variables and overrides.

    Args:
        path: a YAML file, or the name of a shipped preset ("default"). None loads the file named
            by $CADENZA_CONFIG when set, else defaults only.
        overrides: dotted keys (`{"server.port": 9000}`), highest precedence. A None value means
            "not given" and is skipped, so CLI code can pass its unset flags.
        env: the environment (default os.environ). `CADENZA_SECTION__FIELD=value` sets
            section.field (double underscores separate levels); values are read as YAML.

    Raises:
        ConfigError: every problem found, one a line, each naming its source and key path.
    """
    env = os.environ if env is None else env
    merged, problems = _Merged(), []
    if path is not None:
        merged.set_all(*_read_yaml(path), _FILE)
    elif env.get(CONFIG_ENV):
        via = f"environment variable {CONFIG_ENV}"
        merged.set_all(*_read_yaml(env[CONFIG_ENV], via=via), _FILE)
    for loc, value, label in _env_layer(env, problems):
        merged.set(loc, value, _ENV, label)
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        loc, label = tuple(key.split(".")), f"override {key}"
        why = find_key(CadenzaConfig, loc)
        if why:
            problems.append(f"{label}: {key}: {why}")
        else:
            merged.set(loc, value, _OVERRIDE, label)
    merged.drop_shadowed_alternatives()
    try:
        config = CadenzaConfig.model_validate(merged.data)
    except ValidationError as exc:
        problems += validation_problems(CadenzaConfig, exc, merged.source_of)
    if problems:
        raise ConfigError(problems)
    return config


def dump_config(config: CadenzaConfig) -> str:
    """`config` as YAML that `load_config` reads back to an equal config."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def preset_names() -> list[str]:
    """Names of the presets shipped in config/presets."""
    return sorted(p.name.removesuffix(".yaml") for p in _presets().iterdir()
                  if p.name.endswith(".yaml"))  # fmt: skip


def _presets() -> Traversable:
    # importlib.resources, not __file__, so presets are found in wheels and zip installs alike.
    return resources.files("cadenza.config") / "presets"


def _read_yaml(path: str | os.PathLike[str], via: str = "") -> tuple[dict, str]:
    """The mapping in a YAML file or preset, and the label its problems are reported under."""
    text_path = os.fspath(path)
    prefix = f"{via}: " if via else ""
    is_bare_name = os.sep not in text_path and "/" not in text_path and "." not in text_path
    file: Path | Traversable = Path(text_path)
    if is_bare_name and (_presets() / f"{text_path}.yaml").is_file():
        file = _presets() / f"{text_path}.yaml"
        text_path = str(file)  # report a preset's problems under its file
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        hint = f" (nor a preset: {', '.join(preset_names())})" if is_bare_name else ""
        raise ConfigError(f"{prefix}config file not found: {text_path}{hint}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{prefix}{text_path}: cannot read config file: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{prefix}{text_path}: YAML syntax error{where}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{prefix}{text_path}: YAML error: {exc}") from None
    if data is None:  # an empty file, or only comments
        return {}, text_path
    if not isinstance(data, dict):
        raise ConfigError(
            f"{prefix}{text_path}: the top level must be a mapping of config sections "
            f"(got {type(data).__name__})"
        )
    return data, text_path


def _env_layer(env: Mapping[str, str], problems: list[str]) -> Iterator[tuple[Loc, Any, str]]:
    """(key path, value, source) for each CADENZA_* variable; bad names go to `problems`."""
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in RESERVED_ENV:
            continue
        label = f"environment variable {name}"
        loc = _env_loc(name)
        why = find_key(CadenzaConfig, loc)
        if why:
            better = _env_respelling(name)
            why = f"not a config key (did you mean {better}?)" if better else why
            problems.append(f"{label}: {key_path(loc)}: {why}")
            continue
        yield loc, _env_value(loc, env[name]), label


def _env_loc(name: str) -> Loc:
    return tuple(name[len(ENV_PREFIX) :].lower().split("__"))


def _env_respelling(name: str) -> str | None:
    """CADENZA_SERVER_PORT -> CADENZA_SERVER__PORT: `name` with some `_` doubled, when valid."""
    pieces = re.split(r"(__|_)", name[len(ENV_PREFIX) :])
    singles = [i for i, piece in enumerate(pieces) if piece == "_"]
    for choice in itertools.islice(itertools.product(("_", "__"), repeat=len(singles)), 1, 256):
        for i, sep in zip(singles, choice):
            pieces[i] = sep
        candidate = ENV_PREFIX + "".join(pieces)
        if find_key(CadenzaConfig, _env_loc(candidate)) is None:
            return candidate
    return None


def _env_value(loc: Loc, raw: str) -> Any:
    """`raw` read as YAML, but text fields keep it verbatim: an api_key 0123 stays "0123"."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw  # not YAML, so plain text; validation judges it
    if value is None or isinstance(value, str):
        return value
    parent: Any = CadenzaConfig
    for part in loc[:-1]:
        parent = section_model(parent, part)
    annotation = parent.model_fields[loc[-1]].annotation
    return raw if annotation in (str, str | None) else value


class _Merged:
    """The raw config merged layer over layer, and for each leaf the layer that set it."""

    def __init__(self) -> None:
        self.data: dict[Any, Any] = {}
        self.sources: dict[Loc, tuple[int, str]] = {}  # leaf key path -> (rank, label)
        # Mappings set, as a fallback for errors about a key with no leaves (`servr: {}`).
        self.mappings: dict[Loc, tuple[int, str]] = {}

    def set_all(self, data: Mapping[Any, Any], label: str, rank: int) -> None:
        for key, value in data.items():
            self.set((key,), value, rank, label)

    def set(self, loc: Loc, value: Any, rank: int, label: str) -> None:
        """Set `loc` to `value`; mappings merge into mappings key by key, anything else replaces."""
        node = self.data
        for depth, part in enumerate(loc[:-1]):
            if not isinstance(node.get(part), dict):
                self._forget(loc[: depth + 1])
                node[part] = {}
            node = node[part]
        if isinstance(value, Mapping):
            if not isinstance(node.get(loc[-1]), dict):
                self._forget(loc)
                node[loc[-1]] = {}
            self.mappings[loc] = max(self.mappings.get(loc, (rank, label)), (rank, label))
            for key, item in value.items():
                self.set((*loc, key), item, rank, label)
        else:
            self._forget(loc)
            node[loc[-1]] = value
            self.sources[loc] = (rank, label)

    def get(self, loc: Loc) -> Any:
        node: Any = self.data
        for part in loc:
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def drop_shadowed_alternatives(self) -> None:
        for a, b in _ALTERNATIVES:
            if a in self.sources and b in self.sources and self.sources[a][0] != self.sources[b][0]:
                lower, higher = sorted((a, b), key=lambda loc: self.sources[loc][0])
                if self.get(higher) is not None:
                    self._forget(lower)
                    del self.get(lower[:-1])[lower[-1]]

    def source_of(self, loc: Loc) -> str:
        """The highest layer that set `loc`, a key above it, or a key below it (section errors)."""
        for sources in (self.sources, self.mappings):
            best: tuple[int, str] | None = None
            for path, source in sources.items():
                n = min(len(path), len(loc))
                if path[:n] == loc[:n] and (best is None or source[0] > best[0]):
                    best = source
            if best:
                return best[1]
        return "defaults"

    def _forget(self, loc: Loc) -> None:
        for path in [p for p in self.sources if p[: len(loc)] == loc]:
            del self.sources[path]
