"""One error shape for every failure the HTTP layer reports, OpenAI style.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` with a matching HTTP
status, all its text escaped to ASCII. Request validation failures (malformed JSON, unknown or ill-typed fields) are 400, never
FastAPI's 422. A 500 never carries exception text or a traceback.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "invalid_request_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable",
    HTTPStatus.INTERNAL_SERVER_ERROR: "internal_server_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(
    status: HTTPStatus, message: str, param: str | None = None, code: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


class _ASCIIJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message may quote a client's text,
    which may hold characters (lone surrogates) that UTF-8 cannot encode."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(error: APIError) -> JSONResponse:
    return _ASCIIJSONResponse(
        error_body(error.status, error.message, error.param, error.code),
        status_code=error.status,
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "extra_forbidden":
        return f"unknown field {param!r}", param
    if first.get("type") == "value_error" and "error" in first.get("ctx", {}):
        message = str(first["ctx"]["error"])
        return (f"{param}: {message}" if param else message), param
    return (f"{param}: {first.get('msg')}" if param else str(first.get("msg"))), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(HTTPStatus.BAD_REQUEST, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = HTTPStatus(exc.status_code)
        return error_response(APIError(status, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving %s", request.url.path)
        return error_response(
            APIError(HTTPStatus.INTERNAL_SERVER_ERROR, "internal server error")
        )
