"""The manager's outputs, delivered to the asyncio handlers that wait for them.

One pump thread takes every output off the manager (``get_result``) and hands it to the
subscriber of its request on that subscriber's event loop. A handler subscribes its request ids
*before* it adds the requests, so no output can arrive unclaimed; an output for a request nobody
listens to any more (a client that left) is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Hashable, Iterable

__all__ = ["OutputPump"]

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how long one get_result waits before the pump looks at its stop flag again


class OutputPump:
    def __init__(self, manager):
        self.manager = manager
        self._subscribers: dict[Hashable, tuple[asyncio.AbstractEventLoop, Callable]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="genfn-serve-outputs", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def subscribe(self, request_ids: Iterable[Hashable], callback: Callable) -> None:
        """Call ``callback(output)`` on the caller's running loop for each output of these requests."""
        loop = asyncio.get_running_loop()
        with self._lock:
            for request_id in request_ids:
                self._subscribers[request_id] = (loop, callback)

    def unsubscribe(self, request_ids: Iterable[Hashable]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._subscribers.pop(request_id, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            output = self.manager.get_result(timeout=_POLL_S)
            if output is None:
                if not self.manager.is_running():
                    self._stop.wait(_POLL_S)  # get_result returns at once while nothing produces
                continue
            with self._lock:
                entry = self._subscribers.get(output.request_id)
                if entry is not None and output.is_finished():
                    del self._subscribers[output.request_id]
            if entry is None:
                logger.debug("dropping an output of %r: nobody waits for it", output.request_id)
                continue
            loop, callback = entry
            try:
                loop.call_soon_threadsafe(callback, output)
            except RuntimeError:  # that loop is closed: its handler is gone
                pass
