"""The manager's outputs, delivered to the asyncio handlers that wait for them.

The manager delivers them itself (``register_result_handler``: each output is handed to the
handler's event loop with ``call_soon_threadsafe`` as the loop thread makes it); no thread here
polls for them. A handler subscribes its request ids *before* it adds the requests, so no output
can arrive unclaimed; the outputs of a request nobody listens to any more (a client that left)
are dropped (``remove_result_handler``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

__all__ = ["OutputPump"]


class OutputPump:
    def __init__(self, manager):
        self.manager = manager

    def start(self) -> None:
        """Nothing to start: the manager delivers the outputs."""

    def close(self, timeout: float = 5.0) -> None:
        """Nothing to stop: the manager delivers the outputs."""

    def subscribe(self, request_ids: Iterable[Hashable], callback: Callable) -> None:
        """Call ``callback(output)`` on the caller's running loop for each output of these requests."""
        for request_id in request_ids:
            self.manager.register_result_handler(request_id, callback)

    def unsubscribe(self, request_ids: Iterable[Hashable]) -> None:
        for request_id in list(request_ids):
            self.manager.remove_result_handler(request_id)
