"""The HTTP connection's own limits, below the application: the body size (`BodyLimit`), the time a
client may take to send its headers (`header_timeout_protocol`), and the address to listen on."""

from __future__ import annotations

import asyncio
import json
import socket

from ..runtime.errors import TfmError


class BodyLimit:
    """ASGI wrapper: a request body over `limit` bytes gets 413 before it is read to the end (by its
    Content-Length, or as soon as a streamed body passes the limit); the rest pass unchanged."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._refuse(send, declared.decode("latin-1")[:20])
        body = bytearray()
        while True:  # read it here, bounded, and hand it on whole
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            if len(body) > self.limit:
                return await self._refuse(send, f"more than {len(body)}")
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: str) -> None:
        content = json.dumps({"error": f"request body: {size} bytes, more than this server's limit of "
                                       f"{self.limit} (tfm serve --max-body-bytes)"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content})


def listening_address(host: str) -> tuple[str, bool]:
    """`--host` → (the address as a URL writes it, whether it is loopback only); an empty or
    unresolvable host is a TfmError (an unset `$HOST` must not mean every interface)."""
    import ipaddress

    if not host.strip():
        raise TfmError("--host is empty: give an address, e.g. 127.0.0.1 (this machine only, the default) "
                       "or 0.0.0.0 (every interface)")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise TfmError(f"--host {host!r}: not an address this machine can listen on ({exc})") from None
    loopback = all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
    return (f"[{host}]" if ":" in host else host), loopback


def header_timeout_protocol(timeout: float) -> type:
    """uvicorn's HTTP/1.1 protocol (h11) with a deadline for each request's headers: a connection
    that has not sent a whole request head `timeout` seconds after it opened (or after its last
    response) is closed. uvicorn has a keep-alive timeout for idle connections, but none for a
    client that sends its headers a byte at a time (slowloris), which held connections forever."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeout(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _await_headers(self) -> None:
            self._stop_waiting()
            self._header_timer = self.loop.call_later(timeout, self._headers_too_slow)

        def _stop_waiting(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the head is in
                self._stop_waiting()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_headers()  # the next request's head, on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            super().connection_lost(exc)

    return HeaderTimeout
