"""One HTTP request's generation: its choices as manager requests, and their outputs as they come.

``Run.submit`` subscribes to the outputs first and then adds one manager request per choice
(each with its own seed); ``Run.next`` waits for the next output of any choice, bounded by the
server's drain deadline; ``Run.cancel`` cancels the choices that have not ended (a client that
left, a server that is shutting down), which frees their cache blocks.

A request's outputs are cumulative (each holds every token so far), so a run keeps only the
latest undelivered output per choice: a client that reads slowly holds the server's memory to one
output per choice, however far the generation runs ahead (the socket's own flow control holds
back the response writer).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Sequence

from genfn.batching.requests import sequence_ids
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
        self._index: dict[str, int] = {}
        self.open: set[str] = set()  # requests that have not ended
        self._latest: dict[str, object] = {}  # per choice, its newest output not yet taken (insertion order)
        self._arrived = asyncio.Event()
        self._adding = threading.Lock()
        self._added: list[str] = []
        self._abandoned = False

    async def submit(self, prompts: Sequence[list[int]], settings: Sequence[dict], streaming: bool,
                     sequences: int = 1) -> None:
        """Add one manager request per (prompt, settings) pair, on a worker thread: resolving a
        request's settings (stop strings scan the vocabulary) must not hold up the event loop. A
        refusal cancels the ones added. ``sequences``: choices each request gives (a beam
        request's hypotheses, ``sequence_ids``), numbered consecutively."""
        tag = uuid.uuid4().hex[:12]
        self._bases = [f"{self.prefix}-{tag}-{i}" for i in range(len(prompts))]
        self.request_ids = [rid for base in self._bases for rid in sequence_ids(base, sequences)]
        self._index = {request_id: i for i, request_id in enumerate(self.request_ids)}
        self.pump.subscribe(self.request_ids, self.deliver)
        self.open = set(self.request_ids)
        try:
            await asyncio.to_thread(self._add_all, prompts, settings, streaming, sequences)
        except (ValueError, TypeError) as exc:
            self.cancel()
            raise APIError(str(exc), status=400) from None

    def _add_all(self, prompts, settings, streaming: bool, sequences: int) -> None:
        for base, prompt, kwargs in zip(self._bases, prompts, settings):
            with self._adding:  # cancel() either sees this request added or stops the ones after it
                if self._abandoned:
                    return
                self.manager.add_request(prompt, request_id=base, streaming=streaming, **kwargs)
                self._added.extend(sequence_ids(base, sequences))

    def deliver(self, output) -> None:
        """Called on the event loop with each output: it replaces the choice's undelivered one."""
        self._latest[output.request_id] = output
        self._arrived.set()

    @property
    def backlog(self) -> int:
        """Outputs held for the handler (at most one per choice)."""
        return len(self._latest)

    def index(self, request_id: str) -> int:
        return self._index[request_id]

    async def next(self):
        """The next output of any open choice (it leaves ``open`` when it is final)."""
        while True:
            if self.drain.expired():
                raise shutting_down()
            if not self._latest:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), _WAIT_SLICE_S)
                except asyncio.TimeoutError:
                    pass
                continue
            request_id = next(iter(self._latest))
            output = self._latest.pop(request_id)
            if output.is_finished():
                self.open.discard(output.request_id)
            return output

    def cancel(self) -> None:
        """Cancel every choice that has not ended (also those the worker has yet to add)."""
        with self._adding:
            self._abandoned = True
            added = set(self._added)
        for request_id in sorted(self.open & added):
            self.manager.cancel_request(request_id)
        self.pump.unsubscribe(self.open)
        self.open.clear()
