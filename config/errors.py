"""`ConfigError` and how problems become messages that name their source and key path."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from cadenza.config.schema import section_model

Loc = tuple[Any, ...]
SECRETS = {"api_key", "api_keys"}  # config keys whose values an error never quotes


class ConfigError(ValueError):
    """The configuration is invalid. One line per problem, each `<source>: <key.path>: <why>`.

    `problems` holds those lines, for callers that render them themselves.
    """

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def key_path(loc: Iterable[Any]) -> str:
    """`("plugins", 0)` -> `plugins[0]`, `("model", "dtype")` -> `model.dtype`."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or "(top level)"


def unknown_key(key: Any, choices: Iterable[str]) -> str:
    """Why `key` is rejected, with the closest valid key when one is close enough."""
    choices = list(choices)
    close = difflib.get_close_matches(str(key), choices, n=1)
    if close:
        return f"unknown key (did you mean {close[0]!r}?)"
    return f"unknown key (expected one of: {', '.join(choices)})"


def find_key(root: type[BaseModel], loc: Sequence[Any]) -> str | None:
    """None when `loc` names a config key under `root`, else why not (for env and overrides).

    A key path may stop at a section (its value is then a mapping) or at a leaf, not below a leaf.
    """
    model: type[BaseModel] | None = root
    for depth, part in enumerate(loc):
        if model is None:
            return f"unknown key ({key_path(loc[:depth])} has no sub-keys)"
        if part not in model.model_fields:
            return unknown_key(part, model.model_fields)
        model = section_model(model, part)
    return None


def _model_at(root: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root
    for part in loc:
        if model is None or part not in model.model_fields:
            return None
        model = section_model(model, part)
    return model


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validation_problems(
    root: type[BaseModel], error: ValidationError, source_of: Callable[[Loc], str]
) -> list[str]:
    """One line per pydantic error, attributed by `source_of(loc)` to where the value came from."""
    problems = []
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            model = _model_at(root, loc[:-1])
            why = unknown_key(loc[-1], model.model_fields if model else ())
        else:
            # Our validators raise ValueError; pydantic prefixes those with "Value error, ".
            why = err["msg"].removeprefix("Value error, ")
            value = err.get("input")
            # A whole section as "got" is noise; model-level messages quote their fields; a key is a secret.
            if err["type"] != "missing" and not isinstance(value, (dict, BaseModel)) and not SECRETS & set(loc):
                why += f" (got {_short(value)})"
        problems.append(f"{source_of(loc)}: {key_path(loc)}: {why}")
    return problems
