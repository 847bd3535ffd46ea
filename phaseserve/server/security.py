"""Who may call the server, and how much they may send: API keys, tenants, ``/metrics`` access, the body limit.

:class:`Auth` holds the configured keys (``experiment.api_keys``: a mapping API key -> tenant name, and
``experiment.metrics_key``). With keys configured every route but ``/health`` needs ``Authorization: Bearer
<key>``; a missing or unknown key is a 401 in OpenAI's error body (``code: "invalid_api_key"``). The caller's
tenant names its prefix-cache partition (:func:`cache_tenant`): keys of one tenant share cached prefixes, keys of
different tenants never do, and the request's ``user`` field only narrows the partition. ``/metrics`` takes the
metrics key alone (when one is set, with or without API keys); with API keys and no metrics key it is closed.

:class:`Gate` is the ASGI middleware that applies both before any handler runs: authentication (401), then the
request-body limit (413), from ``Content-Length`` when sent and otherwise counted as the body arrives
(:class:`BodyTooLargeError`, raised inside the handler's body read and answered by the app's exception handler).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phaseserve.server.schemas import error_body

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a prompt at the default model's whole context is a few KiB of JSON
OPEN_PATHS = ("/health",)  # liveness probes: no key needed


class BodyTooLargeError(HTTPException):
    """Raised from the body read (an ``HTTPException``, so FastAPI passes it on); the app answers 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body exceeds the server's limit of {limit} bytes")
        self.limit = limit


def too_large(limit: int) -> JSONResponse:
    return JSONResponse(error_body(f"the request body exceeds the server's limit of {limit} bytes",
                                   code="request_too_large"), status_code=413)


def cache_tenant(tenant: str, user: str | None) -> str:
    """The prefix-cache tenant of a request: the authenticated caller's ``tenant``, narrowed by ``user`` when the
    request names one (two callers share cached pages only if both parts are equal; ``user`` can never reach
    another tenant's partition)."""
    return tenant if user is None else json.dumps([tenant, user])


class Auth:
    """API keys -> tenants, and the metrics key. Keys are compared in constant time."""

    def __init__(self, api_keys: Mapping[str, str] | None = None, metrics_key: str | None = None):
        keys = dict(api_keys or {})
        for k, t in keys.items():
            if not isinstance(k, str) or not k or not isinstance(t, str):
                raise ValueError("api_keys maps non-empty key strings to tenant-name strings")
        if metrics_key is not None and (not isinstance(metrics_key, str) or not metrics_key):
            raise ValueError("metrics_key must be a non-empty string or None")
        if metrics_key is not None and metrics_key in keys:
            raise ValueError("the metrics key must differ from every API key")
        self._keys = [(k.encode(), t) for k, t in keys.items()]
        self._metrics = metrics_key.encode() if metrics_key else None

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, key: str | None) -> str | None:
        """The tenant of ``key``, or None if it is not a configured API key (every key is compared)."""
        found = None
        given = (key or "").encode()
        for k, t in self._keys:
            if hmac.compare_digest(k, given) and found is None:
                found = t
        return found

    def may_read_metrics(self, key: str | None) -> bool:
        if self._metrics is None:
            return not self.enabled  # no keys at all: an open (development) server
        return hmac.compare_digest(self._metrics, (key or "").encode())


def bearer(headers: Headers) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (None if absent or of another scheme)."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def _unauthorized(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, code="invalid_api_key"), status_code=401,
                        headers={"www-authenticate": "Bearer"})


class Gate:
    """ASGI middleware: authentication, then the body limit, for every HTTP request; the caller's tenant is put in
    the request's state (``request.state.tenant``, "" when no keys are configured)."""

    def __init__(self, app: ASGIApp, auth: Auth, max_body_bytes: int | None):
        self.app, self.auth, self.limit = app, auth, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        tenant = ""
        if scope["path"] == "/metrics":
            if not self.auth.may_read_metrics(bearer(headers)):
                await _unauthorized("/metrics needs the metrics key")(scope, receive, send)
                return
        elif self.auth.enabled and scope["path"] not in OPEN_PATHS:
            tenant = self.auth.tenant(bearer(headers))
            if tenant is None:
                await _unauthorized("a valid API key is required (Authorization: Bearer <key>)")(scope, receive,
                                                                                                send)
                return
        scope.setdefault("state", {})["tenant"] = tenant
        if self.limit is None:
            await self.app(scope, receive, send)
            return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await too_large(self.limit)(scope, receive, send)
            return
        await self.app(scope, self._counted(receive), send)

    def _counted(self, receive: Receive) -> Receive:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLargeError(self.limit)
            return msg

        return counted
