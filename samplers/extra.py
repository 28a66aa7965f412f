"""Per-request plugin parameters: validating `SamplingParams.extra` against the configured plugins.

`extra` maps a sampler's or logits processor's name to its parameters: a dict checked against the
class's `params_model`, True for the model's defaults, or None / False for off. The ingress checks
it before a request is admitted (so a bad value fails at once, with the field named); the pipeline
parses it again once, when the request first reaches a batch, to hand the models to the plugins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable

from pydantic import BaseModel, ValidationError


class ExtraParamsError(ValueError):
    """`SamplingParams.extra` names no configured plugin, or a plugin's params are invalid.

    The message starts with the field path, e.g. `extra.banned_words.words[0]: ...`.
    """


def is_on(value: Any) -> bool:
    """Whether an `extra` value switches its plugin on (None and False leave it off)."""
    return value is not None and value is not False


def field_path(loc: Iterable[Any]) -> str:
    """A pydantic error location as a path: ("words", 0) -> "words[0]"."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


class ExtraParams:
    """The plugins a deployment runs that may take per-request params, by name."""

    def __init__(self, components: Mapping[str, type]) -> None:
        self.components = dict(components)

    @property
    def names(self) -> list[str]:
        return sorted(self.components)

    def validate(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        """The validated params of every plugin `extra` switches on, by name.

        Raises `ExtraParamsError` for a key naming no configured plugin (listing the configured
        ones) or for params the plugin's `params_model` rejects (every bad field, named).
        """
        if not extra:
            return {}
        if not isinstance(extra, Mapping):
            raise ExtraParamsError(f"extra: must be an object keyed by plugin name (got {type(extra).__name__})")
        parsed: dict[str, Any] = {}
        for name, value in extra.items():
            cls = self.components.get(name)
            if cls is None:
                raise ExtraParamsError(
                    f"extra.{name}: no sampler or logits processor named {name!r} runs here; "
                    f"known: {', '.join(self.names) or '(none)'}"
                )
            if is_on(value):
                parsed[name] = self._parse(name, cls.params_model, value)
        return parsed

    @staticmethod
    def _parse(name: str, model: type[BaseModel] | None, value: Any) -> Any:
        if model is None:
            return value  # the plugin takes whatever it is given
        if value is True:
            value = {}
        if isinstance(value, BaseModel):
            value = value.model_dump()
        if not isinstance(value, Mapping):
            raise ExtraParamsError(
                f"extra.{name}: expected an object of parameters, true or false (got {type(value).__name__})"
            )
        try:
            return model.model_validate(dict(value))
        except ValidationError as exc:
            problems = [
                f"{field_path(('extra', name, *err['loc']))}: {err['msg']}" for err in exc.errors(include_url=False)
            ]
            raise ExtraParamsError("; ".join(problems)) from None
