"""structlog configuration: readable lines on a terminal, JSON lines for machines."""

from __future__ import annotations

import logging
import re
import sys
from typing import Any, Iterable

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


# A browser's WebSocket cannot set headers, so an API key may travel in the query string: every
# query value, bearer token and known secret is masked before a line is written.
_QUERY_VALUE = re.compile(r"([?&][^=&\s\"'#]+=)[^&\s\"'#]+")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s\"',]+")
MASK = "***"


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with query-string values, bearer tokens and each of `secrets` masked."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return _BEARER.sub(r"\1" + MASK, _QUERY_VALUE.sub(r"\1" + MASK, text))


class _RedactRecords(logging.Filter):
    """Masks secrets in stdlib records (uvicorn logs a WebSocket's path with its query string)."""

    def __init__(self, secrets: tuple[str, ...]) -> None:
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.msg, record.args = redact(record.getMessage(), self.secrets), None
        except Exception:  # a malformed record: logging reports it as it would have
            pass
        return True


def _redact_event(secrets: tuple[str, ...]):
    def processor(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        return {k: redact(v, secrets) if isinstance(v, str) else v for k, v in event.items()}

    return processor


def configure_logging(level: str = "info", fmt: str = "auto", stream=None, secrets: Iterable[str | None] = ()) -> None:
    """structlog for cadenza's own events; stdlib logging (uvicorn's lifecycle lines) rendered the
    same way. Every line is redacted: query-string values, bearer tokens and `secrets` are masked."""
    secrets = tuple(s for s in secrets if s)
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    handler = logging.StreamHandler(stream)
    handler.addFilter(_RedactRecords(secrets))
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso")],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(_LEVELS[level.lower()])
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            _redact_event(secrets),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level.lower()]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
