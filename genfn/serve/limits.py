"""What the server takes of a request body: ``BodyLimit``, an ASGI middleware that refuses a body
over a size with OpenAI's 413, and reads every POST body as JSON whatever its ``Content-Type``
says (``curl -d`` declares form encoding; the API takes nothing but JSON).

A declared ``Content-Length`` over the limit is refused before a byte of the body is read; a
body sent without one (chunked) is counted as it arrives and refused the moment it passes the
limit, so the server never holds more than the limit of one request in memory.
"""

from __future__ import annotations

import json

from genfn.serve.errors import error_body

__all__ = ["BodyLimit"]


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send, size: str) -> None:
        body = json.dumps(error_body(f"The request body ({size}) is larger than this server's limit of "
                                     f"{self.max_bytes} bytes", param=None, code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get("method") == "POST":
            headers = [(k, v) for k, v in scope.get("headers") or () if k != b"content-type"]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                length = None
            if length is not None and length > self.max_bytes:
                return await self._refuse(send, f"{length} bytes")
        received = 0
        started = False

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge()
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(send, f"over {self.max_bytes} bytes")
