"""What the HTTP layer enforces before a route runs: the API key and the request body limit.

``RequestGuard`` is plain ASGI middleware, outside routing and body parsing. Invariants:

* With an API key set, every ``/v1`` route needs ``Authorization: Bearer <key>`` (compared in
  constant time); a missing or wrong key is a 401 in the OpenAI error shape. ``/health`` and
  ``/metrics`` stay open, as a supervisor or a scraper needs them.
* No request body larger than ``max_request_bytes`` is read whole: a declared
  ``Content-Length`` above it is a 413 before any of the body is read, and a body without one is
  counted as it arrives and refused (413) as soon as it passes the limit, before it is parsed.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any

from starlette.exceptions import HTTPException

from tokenspeed_jax.server.errors import APIError, error_response

API_KEY_ENV = "TOKENSPEED_API_KEY"
PROTECTED_PREFIX = "/v1"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def resolve_api_key(configured: str | None) -> str | None:
    """The key to require: the configured one, else ``$TOKENSPEED_API_KEY``, else None."""
    return configured or os.environ.get(API_KEY_ENV) or None


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def too_large(limit: int) -> APIError:
    return APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


class RequestGuard:
    """ASGI middleware: API key on ``/v1`` routes and the body size limit (module docstring)."""

    def __init__(self, app: Callable[..., Awaitable[None]], *, max_request_bytes: int,
                 api_key: str | None) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    def authorized(self, scope: Scope) -> bool:
        if self.expected is None or not scope["path"].startswith(PROTECTED_PREFIX):
            return True
        given = _header(scope, b"authorization") or b""
        return hmac.compare_digest(given, self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.authorized(scope):
            error = APIError(HTTPStatus.UNAUTHORIZED,
                             "a valid API key is required: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
            await error_response(error)(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            await error_response(too_large(self.max_request_bytes))(scope, receive, send)
            return
        await self.app(scope, self._counted(receive), send)

    def _counted(self, receive: Receive) -> Receive:
        """``receive`` that refuses (413) a body once it passes the limit."""
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_request_bytes:
                    raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                        too_large(self.max_request_bytes).message)
            return message

        return counted
