"""API errors in the client's dialect: every 4xx/5xx body is OpenAI's
{"error": {"message", "type", "param", "code"}}, except under /v1/messages (the Anthropic Messages API),
where it is Anthropic's {"type": "error", "error": {"type", "message"}}.

Route code raises APIError; the handlers installed by `install_error_handlers` turn it, and every
error FastAPI or Starlette would answer in their own shape (422 validation bodies, 404/405 for
unknown routes, unexpected exceptions), into that body. The shape follows the request's path, so the
API-key check and body parsing, which run before any Anthropic handler code, answer Anthropic clients
in Anthropic's shape too.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# OpenAI's `type` for each status we answer.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

# Anthropic's `type` for each status (their documented table; 529 is their "overloaded" status).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                    415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "api_error",
                    529: "overloaded_error"}

ANTHROPIC_PATH_PREFIX = "/v1/messages"


class APIError(Exception):
    """An error answered to the client as OpenAI error JSON with the given HTTP status."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        fallback = "invalid_request_error" if self.status_code < 500 else "api_error"
        kind = _ANTHROPIC_TYPES.get(self.status_code, fallback)
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)


def is_anthropic(request: Request) -> bool:
    return request.url.path.startswith(ANTHROPIC_PATH_PREFIX)


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """400 naming one offending field (pydantic's 422 is not what OpenAI or Anthropic clients expect)."""
    errors = e.errors()
    if not errors:
        return APIError(400, "invalid request body")
    # NOTE: a value that fails a union gets one error per member; the deepest one names the member the
    # client meant (a list of blocks with a bad field, rather than "not a string").
    first = max(errors, key=lambda err: len(err.get("loc", ())))
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # NOTE: loc[0] is the request field; later parts can name union members ('prompt', 'list[int]').
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    extra = f" (and {len(errors) - 1} more error{'s' * (len(errors) > 2)})" if len(errors) > 1 else ""
    return APIError(400, f"{where}: {first.get('msg')}{extra}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response(is_anthropic(request))

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return from_validation_error(e).response(is_anthropic(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return APIError(e.status_code, str(e.detail), code=code,
                        headers=getattr(e, "headers", None)).response(is_anthropic(request))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(e).__name__}").response(is_anthropic(request))
