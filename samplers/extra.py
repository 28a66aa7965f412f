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

from cadenza.sampling_params import PLUGIN_FIELDS


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


class RequestParamsError(ExtraParamsError):
    """A request's plugin-served params (`structured_outputs`, say) were refused when prepared:
    an invalid grammar, or no plugin here serves the field. The message starts with the field."""

    code = "invalid_value"


class ExtraParams:
    """The plugins a deployment runs that may take per-request params, by name.

    With the component instances it also prepares requests at the ingress (`prepare`): plugins that
    serve a `SamplingParams` field (`request_field`) or do slow set-up (`prepare_request`) get it
    done there, in a worker thread, before the request is admitted.
    """

    def __init__(self, components: Mapping[str, type], instances: Iterable[Any] = ()) -> None:
        self.components = dict(components)
        instances = list(instances)
        self.fields = {c.request_field: c for c in instances if getattr(c, "request_field", None)}
        self.preparers = {c.name: c for c in instances if _overrides_prepare(c)}

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
            if is_on(value) and getattr(cls, "request_field", None):
                raise ExtraParamsError(f"extra.{name}: this plugin is asked for through the request's "
                                       f"{cls.request_field} field, not extra")
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

    def needs_preparing(self, params: Any) -> bool:
        """Whether `prepare` has anything to do for these `SamplingParams` (one check per field)."""
        if any(getattr(params, f, None) is not None for f in (*PLUGIN_FIELDS, *self.fields)):
            return True
        return bool(self.preparers) and any(name in self.preparers and is_on(v) for name, v in (params.extra or {}).items())

    def prepare(self, params: Any) -> None:
        """Run each plugin's `prepare_request` for this request; `RequestParamsError` if one
        refuses it, or if it sets a field no plugin of this deployment serves."""
        for field in {*PLUGIN_FIELDS, *self.fields}:
            value = getattr(params, field, None)
            if value is None:
                continue
            component = self.fields.get(field)
            if component is None:
                plugin = PLUGIN_FIELDS.get(field, "?")
                raise RequestParamsError(
                    f"{field}: this deployment runs no plugin that serves it; add {plugin!r} to sampling.logits_processors"
                )
            if _overrides_prepare(component):
                _prepare(component, value, field)
        if self.preparers and params.extra:
            for name, value in self.validate(params.extra).items():
                if name in self.preparers:
                    _prepare(self.preparers[name], value, f"extra.{name}")


def _overrides_prepare(component: Any) -> bool:
    from cadenza.samplers.base import SamplingComponent

    return type(component).prepare_request is not SamplingComponent.prepare_request


def _prepare(component: Any, value: Any, field: str) -> None:
    try:
        component.prepare_request(value)
    except ValueError as exc:
        message = str(exc)
        raise RequestParamsError(message if message.startswith(field) else f"{field}: {message}") from None
