"""A request's record in continuous batching: ``RequestStatus`` and the immutable ``RequestState``.

A request's tokens are its prompt followed by what it generated; ``num_computed`` leading tokens
have their keys/values in the paged cache. What remains to compute is the rest, so a prompt, a
prompt continued after a chunk, a recompute after preemption (prompt + generated so far) and a
decode step (the one token sampled last) are the same thing: the next ``remaining`` tokens.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Hashable, Iterable, Mapping
from enum import IntEnum
from types import MappingProxyType

from genfn.batching.records import replaced

__all__ = ["RequestState", "RequestStatus", "make_request", "prefix_salt", "sequence_ids"]


class RequestStatus(IntEnum):
    """transformers' statuses (same values), and CANCELLED for a request ended by ``cancel_request``."""

    PENDING = 0  # waiting for admission (new, or preempted and waiting to be recomputed)
    PREFILLING = 1  # admitted; more than its last token remain to compute (chunked prefill)
    DECODING = 2  # admitted; each step computes its last token and samples the next
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5


@dataclasses.dataclass(frozen=True)
class RequestState:
    """One request, immutable; the scheduler's functions return updated copies.

    ``max_new_tokens``: ``None`` for no limit (the cache's capacity still ends the request).
    ``num_reused``: prompt tokens taken from the prefix cache at the last admission.
    ``arrival``: position in arrival order, set when the scheduler receives the request.
    ``settings``: per-request generation settings, opaque here (the shell's processors read them).
    """

    request_id: Hashable
    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...] = ()
    max_new_tokens: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    status: RequestStatus = RequestStatus.PENDING
    num_computed: int = 0
    num_reused: int = 0
    arrival: int = -1
    preemptions: int = 0
    error: str | None = None
    settings: Mapping = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def replace(self, **changes) -> RequestState:
        return replaced(self, changes)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Prompt then generated tokens: the request's ``input_ids`` as transformers would see them."""
        return self.prompt_ids + self.generated_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated_ids)

    @property
    def remaining(self) -> int:
        """Tokens whose keys/values are still to compute (0 while the request's chunk is in flight)."""
        return self.num_tokens - self.num_computed

    def is_done(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    def reached_limit(self) -> bool:
        """Whether the last generated token ends the request (an EOS token or ``max_new_tokens``)."""
        if not self.generated_ids:
            return False
        if self.generated_ids[-1] in self.eos_token_ids:
            return True
        return self.max_new_tokens is not None and len(self.generated_ids) >= self.max_new_tokens


def _eos_set(eos_token_id) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(f"`eos_token_id` must be an int, a list of ints or None, got {eos_token_id!r}")
    # Negative ids mean "none", as in transformers.
    return frozenset(t for t in ids if t >= 0)


def _token(request_id, token) -> int:
    if isinstance(token, bool):
        raise TypeError(f"request {request_id!r}: `input_ids` must be non-negative ints, got {token!r}")
    try:
        value = operator.index(token)  # numpy and 0-d tensor integers too
    except TypeError:
        raise TypeError(f"request {request_id!r}: `input_ids` must be non-negative ints, got {token!r}") from None
    if value < 0:
        raise ValueError(f"request {request_id!r}: `input_ids` must be non-negative ints, got {value}")
    return value


def make_request(request_id: Hashable, prompt_ids: Iterable[int], max_new_tokens: int | None = None,
                 eos_token_id=None, settings: Mapping | None = None) -> RequestState:
    """A validated new request."""
    prompt = tuple(_token(request_id, t) for t in prompt_ids)
    if not prompt:
        raise ValueError(f"request {request_id!r}: `input_ids` must hold at least one token")
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                       or max_new_tokens < 1):
        raise ValueError(f"request {request_id!r}: `max_new_tokens` must be an int >= 1 or None, "
                         f"got {max_new_tokens!r}")
    return RequestState(
        request_id=request_id,
        prompt_ids=prompt,
        max_new_tokens=max_new_tokens,
        eos_token_ids=_eos_set(eos_token_id),
        settings=MappingProxyType(dict(settings or {})),
    )


def prefix_salt(request: RequestState, boundary: int | None) -> bytes | None:
    """The prefix-cache chains ``request`` joins (``blocks.block_digest``'s salt). A prompt longer than
    ``boundary`` (``SchedulerPolicy.prefix_cache_boundary``: LongRoPE's original context, past which a
    prompt's keys rotate by the long factors) shares blocks only with other such prompts; in the other
    requests the token at position p is rotated by the factors of p alone, so they share freely."""
    return b"long prompt" if boundary is not None and len(request.prompt_ids) > boundary else None


def sequence_ids(request_id: Hashable, count: int) -> list[Hashable]:
    """The ids of a request's ``count`` sequences: its own, then ``"<id>.1"``, ``"<id>.2"``, ... for a
    string id (``(id, j)`` for another)."""
    return [request_id] + [f"{request_id}.{j}" if isinstance(request_id, str) else (request_id, j)
                           for j in range(1, count)]
