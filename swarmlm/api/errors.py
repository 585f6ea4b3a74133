"""The gateway's errors in OpenAI's schema (schemas.error_body): what a route refuses, and what the swarm client
raised, turned into the HTTP status a user can act on."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from swarmlm.api.engine import RequestTimeout
from swarmlm.api.schemas import error_body
from swarmlm.errors import CapacityExceeded, InvalidRequest, MissingBlocks, ServerFailed

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.code, exc.param), status_code=exc.status)


def swarm_error(exc: Exception) -> ApiError:
    """What the swarm client raised -> the HTTP error a user can act on."""
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc), "invalid_request_error", "invalid_request")
    if isinstance(exc, MissingBlocks):
        return ApiError(503, f"the swarm cannot serve the model: {exc}", "service_unavailable", "missing_blocks")
    if isinstance(exc, RequestTimeout):
        return ApiError(504, str(exc), "timeout", "request_timeout")
    if isinstance(exc, (ServerFailed, CapacityExceeded)):
        return ApiError(503, f"the swarm cannot serve the request now: {exc}", "service_unavailable",
                        "swarm_unavailable")
    log.exception("unexpected error while generating")
    return ApiError(500, f"internal error ({type(exc).__name__})", "server_error", "internal_error")


def add_error_handlers(app: FastAPI) -> None:
    """Every error a route meets answers in OpenAI's schema: ours, FastAPI's validation, starlette's 404 / 405, and
    anything else the swarm client raised."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        elif loc:
            message = f"{'.'.join(loc)}: {message}"
        return error_response(ApiError(400, message, "invalid_request_error", "invalid_request",
                                       ".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, str(exc.detail), "invalid_request_error", code))

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> JSONResponse:
        return error_response(swarm_error(exc))
