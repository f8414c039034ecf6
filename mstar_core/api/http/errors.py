"""OpenAI-shaped errors: every bad request becomes a 4xx JSON body that says what to fix."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mstar_core.api.http.bodies import OrjsonResponse
from mstar_core.errors import RequestError

log = logging.getLogger("mstar.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    503: "server_overloaded",
    504: "timeout_error",
}


class ApiError(Exception):
    """Raised by route code: becomes `{"error": {...}}` with this status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.type = type_  # what happened, where the status alone does not say (e.g. which kind of 503)


def retry_after(seconds: float) -> dict[str, str]:
    """Retry-After in whole seconds (HTTP) and `retry-after-ms` in milliseconds (what OpenAI's clients read)."""
    return {"Retry-After": str(max(1, round(seconds))), "retry-after-ms": str(max(1, round(seconds * 1000)))}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response."""
    kind = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, type_: str | None = None) -> OrjsonResponse:
    return OrjsonResponse(error_body(status, message, param, code, type_), status_code=status, headers=headers)


def from_request_error(exc: RequestError) -> ApiError:
    """Map a runtime `RequestError` to an API error: its own `error_type` if it has one; 503 gets Retry-After."""
    status = int(getattr(exc, "status", 400) or 400)
    headers = retry_after(float(getattr(exc, "retry_after_s", 1.0))) if status == 503 else None
    return ApiError(status, str(exc), param=getattr(exc, "param", None), headers=headers,
                    type_=getattr(exc, "error_type", None))


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    parts = []
    first_param = None
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        first_param = first_param or param
        msg = err.get("msg", "invalid value")
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', msg)}); send a JSON object")
        elif err.get("type") == "missing":
            parts.append(f"'{param}' is required")
        elif param:
            parts.append(f"'{param}': {msg}")
        else:
            parts.append(f"the body must be a JSON object matching the schema: {msg}")
    if len(errors) > 5:
        parts.append(f"... and {len(errors) - 5} more")
    return "; ".join(parts), first_param


def install_error_handlers(app: FastAPI) -> None:
    """Make every error, including framework ones, answer in OpenAI's shape; never leak a traceback."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers,
                              type_=exc.type)

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, exc: RequestError):
        err = from_request_error(exc)
        return error_response(err.status, err.message, param=err.param, headers=err.headers, type_=err.type)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError):
        message, param = _describe_validation(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404 and message == "Not Found":
            message = "no such route; see /openapi.json for the routes this server has"
        if exc.status_code == 405:
            message = "method not allowed on this route; see /openapi.json"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception):
        log.exception("internal error while serving a request")
        return error_response(500, f"internal error: {type(exc).__name__}; the server log has the traceback")
