"""Errors on the wire: one exception type, written in OpenAI's error shape for HTTP unless the
protocol that owns the path writes its own (api/protocols.py)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from cadenza.sampling_params import describe_error

# Engine error codes (RequestFailed / NewTokens.error_code) and the HTTP status each deserves.
ENGINE_CODE_STATUS = {
    "invalid_prompt": 400,
    "invalid_messages": 400,
    "invalid_extra": 400,
    "invalid_value": 400,
    "prompt_too_long": 400,
    "queue_full": 429,
    "engine_failed": 503,
    "kv_cache_full": 503,
    "slow_reader": 408,  # the client did not read its output in time
    "sampler_error": 500,
    "step_failed": 500,
    "server_shutdown": 503,  # still running when the shutdown grace ran out
}


class APIError(Exception):
    """A request the server will not serve; `code` is stable, `message` says what to fix."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    @property
    def error_type(self) -> str:
        if self.status == 401:
            return "authentication_error"
        if self.status == 404:
            return "not_found_error"
        if self.status == 429:
            return "rate_limit_error"
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def message_naming_param(self) -> str:
        """The message, beginning with the field at fault (`param: ...`) where one is: how the
        error shapes that have no `param` (Anthropic's, Ollama's) name it, for clients and the
        OpenAPI document's relations to read."""
        if self.param is None or self.message.startswith(f"{self.param}:"):
            return self.message
        return f"{self.param}: {self.message}"


ErrorType = Literal[
    "invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error", "server_error"
]


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong and what to fix.")
    type: ErrorType = Field(description="The error's class, from the HTTP status.")
    param: str | None = Field(description="The request field at fault (dotted for nested ones), if one is.")
    code: str = Field(description="A stable machine-readable code (e.g. invalid_value, model_not_found).")


class ErrorResponse(BaseModel):
    """OpenAI's error shape: the body of every HTTP error response (`APIError.body`)."""

    error: ErrorDetail


_STATUS_MEANING = {
    400: "The request is invalid; `error.param` names the field at fault.",
    401: "A valid API key is required.",
    404: "No such model (or path).",
    408: "The client read its output too slowly.",
    413: "The request body is too large.",
    429: "The server's queue is full; try again later.",
    500: "The request failed inside the engine (a sampler plugin or a model step).",
    503: "The server is starting, shutting down or unhealthy; try again later.",
}


def error_responses(*statuses: int, model: type[BaseModel] = ErrorResponse,
                    meaning: dict[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, each with the `model` body (OpenAI's
    `ErrorResponse` unless another protocol's); `meaning` says what a status means where it differs."""
    said = {**_STATUS_MEANING, **(meaning or {})}
    return {status: {"model": model, "description": said[status]} for status in statuses}


def engine_error(code: str | None, message: str | None) -> APIError:
    code = code or "internal_error"
    return APIError(ENGINE_CODE_STATUS.get(code, 500), code, message or "the request failed")


def validation_error(exc: RequestValidationError) -> APIError:
    """A 400 naming every field at fault (sampling fields with their allowed range)."""
    errors = [{**e, "loc": tuple(p for p in e.get("loc", ()) if p != "body")} for e in exc.errors()]
    first = errors[0] if errors else {}
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "[key]") or None
    problems = "; ".join(describe_error(e) for e in errors)
    code = "unknown_field" if first.get("type") == "extra_forbidden" else "invalid_request"
    if first.get("type") == "json_invalid":
        code = "invalid_json"
    return APIError(400, code, problems or "invalid request", param)


def written(scope: Scope, error: APIError, headers: dict[str, str] | None = None) -> Response:
    """`error` in the shape of the protocol that owns the request's path (`app.state.error_writers`,
    api/protocols.py), OpenAI's where none is set: for the error handlers, a stream refused before
    it began, and the model routing's refusals alike."""
    writers = getattr(scope["app"].state, "error_writers", None) if "app" in scope else None
    if writers is None:
        response: Response = JSONResponse(error.body(), status_code=error.status)
    else:
        response = writers.response(scope["path"], error)
    response.headers.update(headers or {})
    return response


def install_error_handlers(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return written(request.scope, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return written(request.scope, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            allowed = allowed_methods(request)
            headers["Allow"] = ", ".join(allowed)
            message = f"{request.method} is not allowed on {request.url.path}; allowed: {', '.join(allowed)}"
        else:
            message = str(exc.detail)
        return written(request.scope, APIError(exc.status_code, code, message), headers)


def allowed_methods(request: Request) -> list[str]:
    """Every HTTP method some route serves at the request's path (RFC 9110's `Allow`), found by
    asking the routes whether they match the path with each method. Starlette's own 405 names
    only the first route that matched the path, and a path may have several (GET and DELETE of a
    stored response are two routes)."""
    found = []
    for method in _METHODS:
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] == Match.FULL for route in request.app.routes):
            found.append(method)
    return found


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
