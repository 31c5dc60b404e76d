"""What continuous batching hands back: ``GenerationOutput`` (transformers' fields) and its router.

The router delivers each output either to a handler registered for its request (on the
handler's asyncio loop, with ``call_soon_threadsafe``) or to a store that ``get_result`` reads.
The store is keyed by request, so waiting for one request never takes another's output off a
shared queue and puts it back. Every wait is bounded by its timeout and ends early when the
producer closes the store (the loop stopped or failed).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable

from genfn.batching.requests import RequestStatus

__all__ = ["GenerationOutput", "OutputRouter", "RequestRecord"]


@dataclasses.dataclass
class GenerationOutput:
    """One result (final) or one streamed update of a request, with transformers' field names.

    ``logprobs[i]``: the log-probability of ``generated_tokens[i]`` under the model's *raw*
    distribution, ``log_softmax`` of the logits before any processor, penalty, bias or temperature
    (what OpenAI's API and vLLM report by default); ``top_logprobs[i]``: the request's
    ``top_logprobs`` most likely ``(token_id, logprob)`` pairs at that step under the same
    distribution, most likely first (``None`` when the request asked for none).
    ``finish_reason`` (OpenAI's values, on a FINISHED output): ``"stop"`` when it ended on an EOS
    token or a stop string, ``"length"`` when it reached ``max_new_tokens`` (or the longest a
    request may be); ``None`` while it runs and when it was cancelled or failed (see ``status``).
    ``lifespan``: (time the request was first scheduled, time it ended), ``perf_counter`` seconds;
    ``timestamps``: when each generated token was produced (``record_timestamps=True``).
    """

    request_id: Hashable
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    generated_tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None
    status: RequestStatus = RequestStatus.PENDING
    created_time: float = dataclasses.field(default_factory=time.perf_counter)
    lifespan: tuple[float, float] = (-1, -1)
    timestamps: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    # Beam search: the hypothesis' score, sum of its log-probs / generated_len ** length_penalty
    # (generate's ``sequences_scores``); None otherwise.
    sequence_score: float | None = None

    def is_finished(self) -> bool:
        """The request ended: finished, failed or cancelled."""
        return self.status >= RequestStatus.FINISHED


@dataclasses.dataclass
class RequestRecord:
    """What the manager keeps of a live request beyond the scheduler's state: what its outputs
    report besides the tokens."""

    prompt_ids: list[int]
    streaming: bool
    record_timestamps: bool
    created_time: float
    top_logprobs: int = 0  # how many pairs per token the request asked for
    logprobs: list = dataclasses.field(default_factory=list)
    tops: list = dataclasses.field(default_factory=list)
    timestamps: list = dataclasses.field(default_factory=list)
    started: float = -1.0
    last_token: float = -1.0  # when its latest token came (-1: none yet)

    def output(self, request_id: Hashable, status: RequestStatus, generated, error: str | None = None,
               ended: float = -1.0, finish_reason: str | None = None,
               sequence_score: float | None = None) -> GenerationOutput:
        count = len(generated)
        return GenerationOutput(
            request_id=request_id, prompt_ids=list(self.prompt_ids), generated_tokens=list(generated),
            logprobs=list(self.logprobs[:count]), error=error, status=status, created_time=self.created_time,
            lifespan=(self.started, ended), timestamps=list(self.timestamps[:count]) if self.record_timestamps
            else None, top_logprobs=[list(pairs) for pairs in self.tops[:count]] if self.top_logprobs else None,
            finish_reason=finish_reason, sequence_score=sequence_score)


class OutputRouter:
    """Outputs to registered handlers or to per-request stores that ``take`` waits on."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._by_request: dict[Hashable, collections.deque] = {}
        self._order: collections.deque = collections.deque()  # request ids, one entry per stored output
        self._handlers: dict[Hashable, tuple[Callable, asyncio.AbstractEventLoop]] = {}
        self._closed = False

    def register(self, request_id: Hashable, callback: Callable, loop: asyncio.AbstractEventLoop) -> None:
        with self._cond:
            self._handlers[request_id] = (callback, loop)

    def ignore(self, request_id: Hashable) -> None:
        """Drop the request's outputs from now on (its listener left), up to and including its last."""
        with self._cond:
            self._handlers[request_id] = (None, None)
            queue = self._by_request.pop(request_id, None)
            if queue:
                self._order = collections.deque(rid for rid in self._order if rid != request_id)

    def deliver(self, output: GenerationOutput) -> None:
        with self._cond:
            entry = self._handlers.get(output.request_id)
            if entry is not None and output.is_finished():
                del self._handlers[output.request_id]
            if entry is not None and entry[0] is None:
                return
            if entry is None:
                self._by_request.setdefault(output.request_id, collections.deque()).append(output)
                self._order.append(output.request_id)
                self._cond.notify_all()
        if entry is not None:
            callback, loop = entry
            try:
                loop.call_soon_threadsafe(callback, output)
            except RuntimeError:  # the handler's loop is closed: nobody listens any more
                pass

    def open(self) -> None:
        with self._cond:
            self._closed = False

    def close(self) -> None:
        """No more outputs will come (until ``open``): wake every waiter."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _pop(self, request_id: Hashable | None) -> GenerationOutput | None:
        if request_id is None:
            while self._order:
                rid = self._order.popleft()
                queue = self._by_request.get(rid)
                if queue:
                    out = queue.popleft()
                    if not queue:
                        del self._by_request[rid]
                    return out
            return None
        queue = self._by_request.get(request_id)
        if not queue:
            return None
        out = queue.popleft()
        if not queue:
            del self._by_request[request_id]
        self._order.remove(request_id)
        return out

    def take(self, request_id: Hashable | None = None, timeout: float | None = None,
             producing: Callable[[], bool] = lambda: True) -> GenerationOutput | None:
        """The oldest stored output (of ``request_id`` when given), waiting up to ``timeout`` seconds
        (``None``: until one comes or ``producing()`` turns false); ``None`` when none came."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                out = self._pop(request_id)
                if out is not None:
                    return out
                if self._closed or not producing():
                    return None
                left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                if left <= 0:
                    return None
                self._cond.wait(left)

    def pending(self) -> int:
        with self._cond:
            return len(self._order)
