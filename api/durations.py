"""Go's durations, as Ollama's `keep_alive` writes them ("5m", "1h30m", "-1s", "250ms"; a bare
number is seconds): read by Ollama's protocol (which refuses what is none) and by the model pool's
routing (which reads a request's keep_alive before the route does, and leaves a bad one to it)."""

from __future__ import annotations

import re
from typing import Any

_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration_seconds(value: Any) -> float | None:
    """`value` in seconds (negative: forever): a number, or a duration's text; None when it is
    neither (a boolean included)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        return None
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        return None
    return sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
