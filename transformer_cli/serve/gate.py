"""The server's gate, below the endpoints: every request is identified (its API key's name, or its
address), refused with 401 where keys are required and it has none that is right, counted in the
metrics and written to the access log. An ASGI wrapper (as BodyLimit is): no per-request task or
body copy, so it costs the endpoints next to nothing."""

from __future__ import annotations

import contextvars
import json
import time
from typing import Any

from .access import AccessLog, ApiKeys
from .metrics import ServerMetrics

OPEN_PATHS = ("/health", "/")  # without a key: a load balancer's probe has none; the page holds no data
# The request being answered, as the gate saw it (client) and as the endpoint tells it (chars,
# lines): the endpoint runs in the gate's task, so it sees the gate's value.
REQUEST: contextvars.ContextVar[dict] = contextvars.ContextVar("tfm_request")


def request_state() -> dict:
    """The request's record: client, chars, lines (a throwaway one outside a gate: tests of the app)."""
    try:
        return REQUEST.get()
    except LookupError:
        return {"client": "", "chars": 0, "lines": 0}


def client_of(scope: dict) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


class Gate:
    def __init__(self, app: Any, keys: ApiKeys | None, metrics: ServerMetrics | None, log: AccessLog | None):
        self.app, self.keys, self.metrics, self.log = app, keys, metrics, log

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        path = scope.get("path", "")
        state = {"chars": 0, "lines": 0}
        REQUEST.set(state)
        client = client_of(scope)
        if self.keys is not None and path not in OPEN_PATHS:
            name = self.keys.identify(_header(scope, b"authorization"))
            if name is None:
                if self.metrics is not None:
                    self.metrics.rejected.labels(reason="no valid key").inc()
                await _answer(send, 401, "this server needs an API key: send the header 'Authorization: Bearer "
                                         "<key>' (ask the operator for one)", {b"www-authenticate": b"Bearer"})
                self._record(client, scope, 401, started, state)
                return
            client = name
        state["client"] = client
        status = [500]

        async def noted(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noted)
        finally:
            self._record(client, scope, status[0], started, state)

    def _record(self, client: str, scope: dict, status: int, started: float, state: dict) -> None:
        seconds = time.monotonic() - started
        path = scope.get("path", "")
        if self.metrics is not None:
            endpoint = path if path in ("/translate", "/translate/file", "/", "/health", "/metrics", "/languages", "/detect") else "other"
            self.metrics.answered(endpoint, status, seconds)
        if self.log is not None:
            self.log.write(client, scope.get("method", ""), path[:200], status, state.get("chars", 0),
                           state.get("lines", 0), seconds)


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers") or []:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _answer(send, status: int, message: str, headers: dict[bytes, bytes] | None = None) -> None:
    content = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
                            *(headers or {}).items()]})
    await send({"type": "http.response.body", "body": content})
