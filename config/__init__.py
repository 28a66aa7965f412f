"""cadenza's deployment config: pydantic models (schema.py), loading and layering (loader.py).

`load_config()` returns a validated `CadenzaConfig`; `dump_config()` and `config_reference()` back
`cadenza config show` and `cadenza config schema`.

May import: the root's plain data only (sampling bounds); every layer above reads its config
values from here, each value by one owner. `environment.py` declares every environment variable
cadenza reads; `logging_setup.py` configures structlog.
"""

from __future__ import annotations

import json
from typing import Any

from cadenza.config.errors import ConfigError
from cadenza.config.loader import dump_config, load_config, preset_names
from cadenza.config.schema import (
    CacheConfig,
    CadenzaConfig,
    LoggingConfig,
    ModelConfig,
    SamplingConfig,
    SamplingDefaults,
    SchedulerConfig,
    ServerConfig,
    parse_memory_size,
)

__all__ = [
    "CacheConfig",
    "CadenzaConfig",
    "ConfigError",
    "LoggingConfig",
    "ModelConfig",
    "SamplingConfig",
    "SamplingDefaults",
    "SchedulerConfig",
    "ServerConfig",
    "config_reference",
    "dump_config",
    "load_config",
    "parse_memory_size",
    "preset_names",
]

_TYPES = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "null"}
_BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}


def config_reference() -> str:
    """A Markdown reference of every config key: dotted path, type, default, description.

    Rendered from `CadenzaConfig.model_json_schema()`, so it cannot drift from the models.
    """
    schema = CadenzaConfig.model_json_schema()
    lines = [
        "# cadenza configuration reference",
        "",
        "Keys nest in YAML (`server:` then `port: 8000`). Precedence, lowest first: defaults, the",
        "config file, environment variables (`CADENZA_SERVER__PORT=9000`: `__` between levels),",
        "overrides. Every section and key is optional.",
    ]
    _describe(schema, schema.get("$defs", {}), CadenzaConfig().model_dump(mode="json"), (), lines)
    return "\n".join(lines) + "\n"


def _describe(
    schema: dict, defs: dict, defaults: Any, prefix: tuple[str, ...], lines: list[str]
) -> None:
    leaves, sections = [], []
    for name, prop in schema["properties"].items():
        # A sub-model is a $ref; older pydantic wraps it in allOf to attach the description.
        refs = [prop.get("$ref"), *(s.get("$ref") for s in prop.get("allOf", []))]
        ref = next((r for r in refs if r), None)
        (sections if ref else leaves).append((name, prop, ref))
    if leaves and not prefix:
        lines += ["", "## Top-level keys", ""]
    for name, prop, _ in leaves:
        path = ".".join((*prefix, name))
        default, about = json.dumps(defaults[name]), prop.get("description", "")
        lines.append(f"- `{path}` ({_type(prop)}, default `{default}`): {about}")
    for name, prop, ref in sections:
        path = (*prefix, name)
        heading = f"{'#' * (len(path) + 1)} `{'.'.join(path)}`"
        lines += ["", heading, "", prop.get("description", ""), ""]
        _describe(defs[ref.rsplit("/", 1)[-1]], defs, defaults[name], path, lines)


def _type(prop: dict) -> str:
    if "anyOf" in prop:
        return " | ".join(_type(option) for option in prop["anyOf"])
    if "enum" in prop:
        return " | ".join(json.dumps(value) for value in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    kind = prop.get("type", "any")
    text = f"list[{_type(prop.get('items', {}))}]" if kind == "array" else _TYPES.get(kind, kind)
    bounds = [f"{op} {prop[key]}" for key, op in _BOUNDS.items() if key in prop]
    return f"{text} {', '.join(bounds)}" if bounds else text
