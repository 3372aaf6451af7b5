"""One JSON error shape for every failure: `{"error": {"type", "message", "param"}}`.

`ApiError` is raised anywhere in the service with the HTTP status, a machine-readable type, a
message naming what was expected and what arrived, and the offending field (`param`, a dotted
path, or null). The handlers installed by `install_error_handlers` turn it, FastAPI's request
validation errors and Starlette's HTTP errors into that shape; anything else is a 500, which
on client input is a bug (`app.UnexpectedErrors` answers it)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

logger = logging.getLogger("rewa.service")

STATUS_TYPES = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "overloaded",
    503: "unavailable",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or STATUS_TYPES.get(status, "error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"type": self.type, "message": self.message, "param": self.param}}


def invalid(param: str, expected: str, got: object) -> ApiError:
    """A 400 naming the field, what was expected and what arrived."""
    return ApiError(400, f"{param}: expected {expected}, got {_short(got)}", param)


def not_found(what: str, name: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"{what} {name!r} not found", param)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _short(value: object, limit: int = 120) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validation_error(errors: list[dict]) -> ApiError:
    """The ApiError of pydantic's first validation error (FastAPI's request errors or a
    model validated by hand): 400 for malformed JSON, else 422 naming the field, the rule and
    what arrived."""
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part not in ("body", "query")]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return ApiError(400, f"malformed JSON body: {first.get('msg')}", "body")
    got = "nothing" if first.get("type") == "missing" else first.get("input", "nothing")
    message = f"{param or 'body'}: {first.get('msg')}; got {_short(got)}"
    return ApiError(422, message, param)


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route accepts at the request's path (Starlette's own 405 names only
    the first route that matched the path, e.g. POST where GET is accepted too)."""
    return [
        method
        for method in HTTP_METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] is Match.FULL
            for route in request.app.router.routes
        )
    ]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(error.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        headers = dict(error.headers or {})
        if error.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(request))
        return error_response(ApiError(error.status_code, str(error.detail), headers=headers))
