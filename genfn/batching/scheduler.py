"""transformers' scheduler classes, as thin shells over the pure functions of ``scheduling``.

A ``Scheduler`` holds one ``SchedulerState`` value and replaces it under a lock: the manager's
loop schedules and applies results while other threads cancel requests, and every method is one
pure transition. ``state`` is a snapshot (immutable), safe to read from any thread.

``FIFOScheduler`` serves decoding requests first, in arrival order (safety margin 0.15 by
default, as transformers); ``PrefillFirstScheduler`` finishes split prefills first (margin 0.0).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from genfn.batching import guidance_groups as GG
from genfn.batching import scheduling as S
from genfn.batching.requests import RequestState, RequestStatus

__all__ = ["SCHEDULERS", "FIFOScheduler", "PrefillFirstScheduler", "Scheduler", "make_scheduler"]


class Scheduler:
    """Requests from arrival to end; ``schedule_batch`` picks each forward's chunks.

    ``num_blocks`` x ``block_size``: the paged cache's geometry. ``safety_margin`` (``None``: the
    policy's default), ``max_requests_per_batch``, ``chunked_prefill``, ``prefix_caching``,
    ``max_blocks_per_request``, ``prefill_tokens_while_decoding`` and ``prefix_cache_boundary`` are
    ``SchedulerPolicy``'s fields.
    """

    kind = "fifo"

    def __init__(self, num_blocks: int, block_size: int, *, safety_margin: float | None = None,
                 max_requests_per_batch: int = 256, chunked_prefill: bool = True, prefix_caching: bool = True,
                 max_blocks_per_request: int | None = None, prefill_tokens_while_decoding: int | None = None,
                 prefix_cache_boundary: int | None = None):
        policy = S.SchedulerPolicy(kind=self.kind, safety_margin=safety_margin,
                                   max_requests_per_batch=max_requests_per_batch, chunked_prefill=chunked_prefill,
                                   prefix_caching=prefix_caching, max_blocks_per_request=max_blocks_per_request,
                                   prefill_tokens_while_decoding=prefill_tokens_while_decoding,
                                   prefix_cache_boundary=prefix_cache_boundary)
        self._lock = threading.Lock()
        self._state = S.init_scheduler(num_blocks, block_size, policy)

    @property
    def state(self) -> S.SchedulerState:
        return self._state

    @property
    def policy(self) -> S.SchedulerPolicy:
        return self._state.policy

    def reset(self) -> None:
        """Forget every request and the prefix cache; all blocks free."""
        with self._lock:
            self._state = S.reset(self._state)

    def add_waiting_request(self, state: RequestState) -> None:
        """Queue a request (a guided one with its unconditional request, ``guidance_groups``)."""
        with self._lock:
            self._state = GG.add_request(self._state, state)

    def schedule_batch(self, token_budget: int, cache_budget: int | None = None) -> S.ScheduledBatch:
        """The next forward's chunks: at most ``token_budget`` query tokens and ``cache_budget``
        key/value positions read. Requests it preempted are back in the queue; those it failed
        (``batch.failed``) have ended. Where transformers returns ``None`` for "cache full, nothing
        scheduled", this returns an empty batch with ``cache_full`` set."""
        with self._lock:
            self._state, batch = S.schedule(self._state, token_budget, cache_budget)
        return batch

    def update_batch(self, batch: S.ScheduledBatch,
                     new_tokens: Mapping[Hashable, int | Sequence[int]]) -> tuple[RequestState, ...]:
        """Record the forward of ``batch`` (``new_tokens``: sampled tokens of each sampling chunk);
        returns the requests that finished."""
        with self._lock:
            self._state, finished = S.apply_step(self._state, batch, new_tokens)
        return finished

    def advance(self, step: Callable[[S.SchedulerState], tuple[S.SchedulerState, Any]]) -> Any:
        """Run ``step`` (a pure ``state -> (state, outcome)`` transition, such as the engine's step)
        on the state under the lock; returns its outcome."""
        with self._lock:
            self._state, outcome = step(self._state)
        return outcome

    def has_pending_requests(self) -> bool:
        return S.has_pending(self._state)

    def finish_request(self, request_id: Hashable, status: RequestStatus = RequestStatus.FINISHED,
                       error: str | None = None, keep_cached: bool = True) -> RequestState | None:
        """End a request and release its blocks (``keep_cached=False``: none stays in the prefix
        cache); returns it (``None`` if it had ended already)."""
        with self._lock:
            self._state, request = S.finish(self._state, request_id, status, error, keep_cached)
        return request

    def get_active_request_static_outputs(self, request_id: Hashable) -> list[int]:
        """Tokens generated so far by a request not yet ended (empty otherwise)."""
        return S.generated_tokens(self._state, request_id)

    def allocated_blocks(self, request_id: Hashable) -> tuple[int, ...]:
        return S.allocated_blocks(self._state, request_id)

    def set_request_cancellation(self, request_id: Hashable) -> None:
        with self._lock:
            self._state = S.mark_cancelled(self._state, request_id)

    def clear_cancelled_requests(self) -> tuple[RequestState, ...]:
        """End the requests whose cancellation was asked; returns them (status CANCELLED)."""
        with self._lock:
            self._state, cancelled = S.clear_cancelled(self._state)
        return cancelled

    def request_is_cancelled(self, request_id: Hashable) -> bool:
        return S.is_cancelled(self._state, request_id)


class FIFOScheduler(Scheduler):
    """Decoding requests first, in arrival order; then split prefills; then new requests."""

    kind = "fifo"


class PrefillFirstScheduler(Scheduler):
    """Split-prefill continuations first, so a long prompt's first token comes sooner; then decodes."""

    kind = "prefill_first"


SCHEDULERS = {"fifo": FIFOScheduler, "prefill_first": PrefillFirstScheduler}


def make_scheduler(kind: str, num_blocks: int, block_size: int, **options) -> Scheduler:
    if kind not in SCHEDULERS:
        raise ValueError(f"`scheduler_type` must be one of {tuple(SCHEDULERS)}, got {kind!r}")
    return SCHEDULERS[kind](num_blocks, block_size, **options)
