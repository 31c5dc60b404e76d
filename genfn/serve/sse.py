"""A server-sent-events response that notices a client leaving while nothing is being sent.

Starlette's ``StreamingResponse`` (on ASGI 2.4 servers such as uvicorn) only learns of a
disconnect when a write fails, and a request still prefilling or holding back a possible stop
string writes nothing for a while. This response also listens for ``http.disconnect`` and then
cancels the body iterator, whose ``finally`` cancels the generation.
"""

from __future__ import annotations

import json

import anyio
from starlette.responses import StreamingResponse

__all__ = ["SSEResponse", "sse_data", "sse_done", "sse_error"]


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content, *, on_close=None, **kwargs):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)
        # Runs however the response ends, also when the client left before the body started
        # (then the body iterator never runs, nor its ``finally``).
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client is gone
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            if self.on_close is not None:
                self.on_close()


def sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"


def sse_error(body: dict) -> str:
    return f"event: error\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
