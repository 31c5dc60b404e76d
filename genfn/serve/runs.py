"""One HTTP request's generation: its choices as manager requests, and their outputs as they come.

``Run.submit`` subscribes to the outputs first and then adds one manager request per choice
(each with its own seed); ``Run.next`` waits for the next output of any choice, bounded by the
server's drain deadline; ``Run.cancel`` cancels the choices that have not ended (a client that
left, a server that is shutting down), which frees their cache blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence

from genfn.serve.errors import APIError

__all__ = ["Drain", "Run"]

_WAIT_SLICE_S = 0.5  # how often a waiting handler looks at the drain deadline


class Drain:
    """The server's shutdown clock: after ``begin(timeout)``, requests in flight have until the
    deadline to finish, and new ones are refused."""

    def __init__(self) -> None:
        self.deadline: float | None = None

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def begin(self, timeout: float) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + timeout

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


def shutting_down() -> APIError:
    return APIError("the server is shutting down; retry against another instance", status=503,
                    type="server_error", code="server_shutting_down")


class Run:
    def __init__(self, manager, pump, drain: Drain, prefix: str):
        self.manager = manager
        self.pump = pump
        self.drain = drain
        self.prefix = prefix
        self.request_ids: list[str] = []
        self.open: set[str] = set()  # requests that have not ended
        self._queue: asyncio.Queue = asyncio.Queue()

    def submit(self, prompts: Sequence[list[int]], settings: Sequence[dict], streaming: bool) -> None:
        """Add one manager request per (prompt, settings) pair; a refusal cancels the ones added."""
        tag = uuid.uuid4().hex[:12]
        self.request_ids = [f"{self.prefix}-{tag}-{i}" for i in range(len(prompts))]
        self.pump.subscribe(self.request_ids, self._queue.put_nowait)
        self.open = set(self.request_ids)
        added = []
        try:
            for request_id, prompt, kwargs in zip(self.request_ids, prompts, settings):
                self.manager.add_request(prompt, request_id=request_id, streaming=streaming, **kwargs)
                added.append(request_id)
        except (ValueError, TypeError) as exc:
            for request_id in added:
                self.manager.cancel_request(request_id)
            self.pump.unsubscribe(self.request_ids)
            self.open.clear()
            raise APIError(str(exc), status=400) from None

    def index(self, request_id: str) -> int:
        return self.request_ids.index(request_id)

    async def next(self):
        """The next output of any open choice (it leaves ``open`` when it is final)."""
        while True:
            if self.drain.expired():
                raise shutting_down()
            try:
                output = await asyncio.wait_for(self._queue.get(), _WAIT_SLICE_S)
            except asyncio.TimeoutError:
                continue
            if output.is_finished():
                self.open.discard(output.request_id)
            return output

    def cancel(self) -> None:
        for request_id in sorted(self.open):
            self.manager.cancel_request(request_id)
        self.pump.unsubscribe(self.open)
        self.open.clear()
