"""Continuous-batching scheduling as pure functions of an immutable ``SchedulerState``.

One step of the shell is ``schedule -> forward -> apply_step``:

``schedule(state, token_budget, cache_budget) -> (state, ScheduledBatch)``
    picks the chunks of the next forward: at most ``token_budget`` query tokens, at most
    ``cache_budget`` key/value positions attended, at most ``max_requests_per_batch`` requests.
    The order of candidates is the policy: ``"fifo"`` serves decoding requests first (arrival
    order), then split-prefill continuations, then admits waiting requests in arrival order;
    ``"prefill_first"`` serves split-prefill continuations first. A prompt longer than the token
    budget left is split (chunked prefill); a waiting request reuses the cached blocks of its
    longest cached prefix. When an admitted request needs a block and none is left, the most
    recently admitted request not in this batch is *preempted*: its blocks are released, and it
    goes back to the front of the queue with everything it generated, to be recomputed later.
``apply_step(state, batch, new_tokens) -> (state, finished)``
    records the forward's result: the chunks' keys/values are written (their full blocks join
    the prefix cache), each sampling chunk's request gets its new tokens, and requests that hit
    an EOS token or ``max_new_tokens`` end, releasing their blocks.

The state is host-side bookkeeping (Python ints, tuples, read-only mappings); trying an
allocation and dropping it is dropping a value. ``genfn.batching.scheduler`` wraps these
functions in the transformers-style ``Scheduler`` classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType

from genfn.batching import blocks as B
from genfn.batching import groups as G
from genfn.batching.records import replaced
from genfn.batching.requests import RequestState, RequestStatus, prefix_salt

__all__ = ["POLICIES", "ScheduledBatch", "ScheduledChunk", "SchedulerPolicy", "SchedulerState", "add_request",
           "allocated_blocks", "apply_step", "clear_cancelled", "finish", "generated_tokens", "has_pending",
           "init_scheduler", "is_cancelled", "mark_cancelled", "reset", "schedule"]

POLICIES = ("fifo", "prefill_first")
# transformers' defaults: FIFO keeps 15 % of the blocks free for the requests already running.
DEFAULT_SAFETY_MARGIN = {"fifo": 0.15, "prefill_first": 0.0}

def _empty() -> Mapping:
    return MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class SchedulerPolicy:
    """What selects the scheduling code (static: no tensor, no per-step value).

    ``safety_margin``: the fraction of blocks below which (free ones counted) no prefill joins a
    batch that already has work, so running requests keep room to decode. ``max_blocks_per_request``:
    the block-table width the forward is compiled for (``None``: the whole cache).
    ``prefill_tokens_while_decoding``: with chunked prefill, the prompt tokens a batch may carry
    while some request decodes (``None``: all the budget leaves). A forward's time grows with its
    tokens, so a full budget of prefill makes every decoding request wait that long for its
    next token; a cap shortens those waits, at the price of admitting new requests later.
    """

    kind: str = "fifo"
    safety_margin: float | None = None
    max_requests_per_batch: int = 256
    chunked_prefill: bool = True
    prefix_caching: bool = True
    max_blocks_per_request: int | None = None
    prefill_tokens_while_decoding: int | None = None
    prefix_cache_boundary: int | None = None  # see requests.prefix_salt

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"scheduler kind must be one of {POLICIES}, got {self.kind!r}")
        if self.safety_margin is None:
            object.__setattr__(self, "safety_margin", DEFAULT_SAFETY_MARGIN[self.kind])
        if isinstance(self.safety_margin, bool) or not isinstance(self.safety_margin, (int, float)) \
                or not 0.0 <= self.safety_margin <= 1.0:
            raise ValueError(f"`safety_margin` must be a number in [0, 1], got {self.safety_margin!r}")
        for name in ("max_requests_per_batch", "max_blocks_per_request", "prefill_tokens_while_decoding",
                     "prefix_cache_boundary"):
            value = getattr(self, name)
            if value is None and name != "max_requests_per_batch":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {value!r}")
        for name in ("chunked_prefill", "prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerState:
    """Everything the scheduler knows. ``requests`` holds every request not yet ended; ``waiting``
    and ``active`` order them (arrival order, preempted requests at the front of ``waiting``)."""

    policy: SchedulerPolicy
    allocator: B.BlockAllocator
    requests: Mapping[Hashable, RequestState] = dataclasses.field(default_factory=_empty)
    waiting: tuple[Hashable, ...] = ()
    active: tuple[Hashable, ...] = ()
    cancelled: frozenset = frozenset()
    arrivals: int = 0
    # Requests that decode together (beam search's beams), by group id; see genfn.batching.groups.
    groups: Mapping[Hashable, G.RequestGroup] = dataclasses.field(default_factory=_empty)

    def replace(self, **changes) -> SchedulerState:
        return replaced(self, changes)


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``token_ids`` of a request, at positions ``start ..``, computed in the next forward.
    ``samples``: the chunk ends at the request's last token, so its logits give a new token.
    ``num_drafts``: the last ``num_drafts`` of ``token_ids`` are speculative drafts after the
    request's last token (``genfn.batching.speculation``): the forward gives logits at the last
    token and at every draft, and the step keeps the drafts verification accepts. ``logits_from``:
    a row without tokens that samples from that request's logits (a sequence sharing its leader's
    prompt, ``genfn.batching.sequence_groups``)."""

    request_id: Hashable
    start: int
    token_ids: tuple[int, ...]
    samples: bool
    num_drafts: int = 0
    prompt_len: int = 0  # the request's own prompt (LongRoPE's packed forward picks its factors by it)
    logits_from: Hashable | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    """One forward's work and what scheduling it did to requests.

    ``num_tokens``: query tokens; ``kv_read``: key/value positions attended (sum of chunk ends);
    ``preempted``: requests sent back to the queue; ``failed``: requests that can never run
    (ended, with their ``error``); ``cache_full``: nothing ran because blocks ran out.
    """

    chunks: tuple[ScheduledChunk, ...] = ()
    preempted: tuple[Hashable, ...] = ()
    failed: tuple[RequestState, ...] = ()
    cache_full: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def prompt_tokens(self) -> int:
        """Query tokens at prompt positions (a prompt computed, or recomputed after preemption)."""
        return sum(max(0, min(c.end, c.prompt_len) - c.start) for c in self.chunks)

    @property
    def kv_read(self) -> int:
        return sum(c.end for c in self.chunks)

    @property
    def request_ids(self) -> tuple[Hashable, ...]:
        return tuple(c.request_id for c in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        """Every chunk is one sampling token: the batch fits a decode-shaped compiled step
        (transformers' "decode fast path")."""
        return bool(self.chunks) and all(len(c.token_ids) == 1 and c.samples for c in self.chunks)


# ----------------------------------------------------------------------------------------------
# Construction and queries
# ----------------------------------------------------------------------------------------------


def init_scheduler(num_blocks: int, block_size: int, policy: SchedulerPolicy | None = None) -> SchedulerState:
    return SchedulerState(policy=policy or SchedulerPolicy(), allocator=B.init_allocator(num_blocks, block_size))


def reset(state: SchedulerState) -> SchedulerState:
    """No request, every block free, an empty prefix cache; the same policy and block geometry."""
    return init_scheduler(state.allocator.num_blocks, state.allocator.block_size, state.policy)


def has_pending(state: SchedulerState) -> bool:
    return bool(state.requests)


def generated_tokens(state: SchedulerState, request_id: Hashable) -> list[int]:
    request = state.requests.get(request_id)
    return list(request.generated_ids) if request is not None else []


def allocated_blocks(state: SchedulerState, request_id: Hashable) -> tuple[int, ...]:
    """The request's block table (the allocator is the one record of it)."""
    return B.block_table(state.allocator, request_id)


def is_cancelled(state: SchedulerState, request_id: Hashable) -> bool:
    """Cancellation was asked, or the request is no longer (or never was) in the scheduler."""
    return request_id in state.cancelled or request_id not in state.requests


def _capacity_tokens(state: SchedulerState) -> int:
    """The most tokens one request can hold: the whole cache, or the block-table width."""
    alloc = state.allocator
    width = state.policy.max_blocks_per_request
    return alloc.block_size * (alloc.num_blocks if width is None else min(width, alloc.num_blocks))


# ----------------------------------------------------------------------------------------------
# Arrivals and endings
# ----------------------------------------------------------------------------------------------


def add_request(state: SchedulerState, request: RequestState) -> SchedulerState:
    """Queue a new request (status PENDING, nothing computed) at the back of the waiting queue."""
    if not isinstance(request, RequestState):
        raise TypeError(f"`request` must be a RequestState, got {type(request).__name__}")
    if request.request_id in state.requests:
        raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
    request = request.replace(status=RequestStatus.PENDING, num_computed=0, num_reused=0, arrival=state.arrivals)
    return state.replace(
        requests=MappingProxyType({**state.requests, request.request_id: request}),
        waiting=state.waiting + (request.request_id,),
        cancelled=state.cancelled - {request.request_id},
        arrivals=state.arrivals + 1,
    )


def _remove(state: SchedulerState, request_id: Hashable, keep_cached: bool = True) -> SchedulerState:
    """Remove the request (and every member of its group), releasing their blocks."""
    member_of = G.member_index(state.groups) if state.groups else {}
    gone = set(G.members_with(state.groups, member_of, request_id))
    requests = dict(state.requests)
    alloc = state.allocator
    for rid in gone:
        requests.pop(rid, None)
        alloc = B.free_request(alloc, rid, keep_cached=keep_cached and state.policy.prefix_caching)
    groups = state.groups
    if request_id in member_of:
        groups = MappingProxyType({g: v for g, v in groups.items() if g != member_of[request_id]})
    return state.replace(
        allocator=alloc,
        requests=MappingProxyType(requests),
        waiting=tuple(r for r in state.waiting if r not in gone),
        active=tuple(r for r in state.active if r not in gone),
        cancelled=state.cancelled - gone,
        groups=groups,
    )


def finish(state: SchedulerState, request_id: Hashable, status: RequestStatus = RequestStatus.FINISHED,
           error: str | None = None, keep_cached: bool = True) -> tuple[SchedulerState, RequestState | None]:
    """End a request (FINISHED by default; FAILED with ``error``), releasing its blocks; a group
    member ends its whole group (``genfn.batching.groups``).
    ``keep_cached=False``: none of its blocks stays in the prefix cache (their content is not to be
    reused: a request whose keys/values went NaN).

    Returns the ended request, or ``None`` if the scheduler did not hold it (ended already)."""
    if status < RequestStatus.FINISHED:
        raise ValueError(f"`status` must be a terminal status (FINISHED, FAILED, CANCELLED), got {status!r}")
    request = state.requests.get(request_id)
    if request is None:
        return state, None
    return _remove(state, request_id, keep_cached), request.replace(status=status, error=error)


def mark_cancelled(state: SchedulerState, request_id: Hashable) -> SchedulerState:
    """Ask for a cancellation; it takes effect at the next ``clear_cancelled`` (the schedule skips it meanwhile)."""
    return state.replace(cancelled=state.cancelled | {request_id})


def clear_cancelled(state: SchedulerState) -> tuple[SchedulerState, tuple[RequestState, ...]]:
    """End every request whose cancellation was asked; returns them with status CANCELLED."""
    if not state.cancelled:  # every step asks: no copy when there is nothing to end
        return state, ()
    ended = []
    for request_id in sorted(state.cancelled, key=repr):
        state, request = finish(state, request_id, RequestStatus.CANCELLED)
        if request is not None:
            ended.append(request)
    return state.replace(cancelled=frozenset()), tuple(ended)


# ----------------------------------------------------------------------------------------------
# Scheduling
# ----------------------------------------------------------------------------------------------


class _Draft:
    """The batch being built: a working copy of the state's parts that ``schedule`` changes."""

    def __init__(self, state: SchedulerState):
        self.state = state
        self.alloc = state.allocator
        self.requests = dict(state.requests)
        self.waiting = list(state.waiting)
        self.active = list(state.active)
        self.chunks: list[ScheduledChunk] = []
        self.in_batch: set = set()
        self.preempted: list = []
        self.failed: list[RequestState] = []
        self.groups = dict(state.groups)
        self.member_of = G.member_index(state.groups) if state.groups else {}

    def preempt(self, request_id: Hashable) -> None:
        """Send the request back to the queue; a group member takes along every member of its
        group that is admitted and not in this batch (a group is preempted whole)."""
        for rid in G.members_with(self.groups, self.member_of, request_id):
            if rid in self.active and rid not in self.in_batch:
                self._preempt_one(rid)

    def _preempt_one(self, request_id: Hashable) -> None:
        request = self.requests[request_id]
        self.alloc = B.free_request(self.alloc, request_id, keep_cached=self.state.policy.prefix_caching)
        self.requests[request_id] = request.replace(status=RequestStatus.PENDING, num_computed=0, num_reused=0,
                                                    preemptions=request.preemptions + 1)
        self.active.remove(request_id)
        self.waiting.insert(0, request_id)
        self.preempted.append(request_id)

    def fail(self, request_id: Hashable, error: str) -> None:
        """End the request (and every member of its group) FAILED with ``error``."""
        for rid in G.members_with(self.groups, self.member_of, request_id):
            request = self.requests.pop(rid)
            self.alloc = B.free_request(self.alloc, rid, keep_cached=self.state.policy.prefix_caching)
            if rid in self.active:
                self.active.remove(rid)
            if rid in self.waiting:
                self.waiting.remove(rid)
            self.failed.append(request.replace(status=RequestStatus.FAILED, error=error))
        self.groups.pop(self.member_of.get(request_id), None)

    def add_chunk(self, request: RequestState, start: int, count: int) -> None:
        end = start + count
        samples = end == request.num_tokens
        status = RequestStatus.DECODING if samples else RequestStatus.PREFILLING
        self.requests[request.request_id] = request.replace(num_computed=end, status=status)
        self.chunks.append(ScheduledChunk(request.request_id, start, request.token_ids[start:end], samples,
                                          prompt_len=len(request.prompt_ids)))
        self.in_batch.add(request.request_id)

    def victim(self, exclude) -> Hashable | None:
        """The most recently admitted request that can give its blocks back: not in ``exclude``,
        not in this batch (nor any member of its group), not awaiting the result of a forward in
        flight, holding blocks."""
        for request_id in reversed(self.active):
            if request_id in exclude or any(m in self.in_batch for m in
                                            G.members_with(self.groups, self.member_of, request_id)):
                continue
            if self.requests[request_id].remaining > 0 and B.block_table(self.alloc, request_id):
                return request_id
        return None

    def finish(self, cache_full: bool) -> tuple[SchedulerState, ScheduledBatch]:
        state = self.state.replace(
            allocator=self.alloc,
            requests=MappingProxyType(self.requests),
            waiting=tuple(self.waiting),
            active=tuple(self.active),
            groups=MappingProxyType(self.groups) if self.groups != self.state.groups else self.state.groups,
        )
        batch = ScheduledBatch(chunks=tuple(self.chunks), preempted=tuple(self.preempted),
                               failed=tuple(self.failed), cache_full=cache_full and not self.chunks)
        return state, batch


def _check_budget(name: str, value, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1{' or None' if allow_none else ''}, got {value!r}")


def _ordered_active(state: SchedulerState) -> list[Hashable]:
    decoding, prefilling = [], []
    for request_id in state.active:
        request = state.requests[request_id]
        if request.remaining == 0 or request_id in state.cancelled:
            continue
        (decoding if request.status == RequestStatus.DECODING else prefilling).append(request_id)
    by_arrival = lambda rid: state.requests[rid].arrival  # noqa: E731
    decoding.sort(key=by_arrival)
    prefilling.sort(key=by_arrival)
    return decoding + prefilling if state.policy.kind == "fifo" else prefilling + decoding


def schedule(state: SchedulerState, token_budget: int, cache_budget: int | None = None, *,
             max_batch_tokens: int | None = None) -> tuple[SchedulerState, ScheduledBatch]:
    """The next forward's chunks within the budgets; see the module docstring for the policy.

    ``max_batch_tokens``: the most tokens any forward takes (``None``: ``token_budget``), where this
    step's ``token_budget`` may be less (room kept for speculative drafts). A request whose tokens
    can never fit the cache (or the block-table width), or, without chunked prefill, whose prompt
    exceeds ``max_batch_tokens``, ends FAILED with the reason in ``error`` and is listed in
    ``batch.failed``; a prompt that fits a whole forward but not this step's budget waits.
    """
    _check_budget("token_budget", token_budget, allow_none=False)
    _check_budget("cache_budget", cache_budget, allow_none=True)
    _check_budget("max_batch_tokens", max_batch_tokens, allow_none=True)
    if max_batch_tokens is None:
        max_batch_tokens = token_budget
    elif max_batch_tokens < token_budget:
        raise ValueError(f"`max_batch_tokens` ({max_batch_tokens}) must be >= `token_budget` ({token_budget})")
    policy = state.policy
    draft = _Draft(state)
    tokens_left, kv_left, rows_left = token_budget, cache_budget, policy.max_requests_per_batch
    capacity = _capacity_tokens(state)
    num_blocks = state.allocator.num_blocks
    in_margin = B.num_free_blocks(state.allocator) >= policy.safety_margin * num_blocks
    allocation_failed = False
    prefill_left = None  # prompt tokens this batch may still take (None: no cap)
    if policy.chunked_prefill and policy.prefill_tokens_while_decoding is not None and any(
            state.requests[r].status == RequestStatus.DECODING for r in state.active):
        prefill_left = policy.prefill_tokens_while_decoding

    def chunk_size(request: RequestState, start: int) -> int:
        """Tokens of ``request`` from ``start`` that fit the budgets left (0: none)."""
        last = G.last_to_compute(request, request.request_id in draft.member_of)
        count = min(last - start, tokens_left)
        if prefill_left is not None and request.status != RequestStatus.DECODING:
            count = min(count, prefill_left)
        if kv_left is not None:
            count = min(count, kv_left - start)
        if count <= 0 or (not policy.chunked_prefill and count < last - start):
            return 0
        return count

    for request_id in _ordered_active(state):
        if tokens_left == 0 or rows_left == 0:
            break
        if request_id not in draft.active or request_id in draft.in_batch:  # preempted, or scheduled with its group
            continue
        request = draft.requests[request_id]
        gid = draft.member_of.get(request_id)
        if gid is not None and gid in draft.groups and G.group_ready(draft.groups[gid], draft.requests, draft.active,
                                                                     draft.in_batch):
            taken, reads, failed = G.add_group(draft, draft.groups[gid].members, capacity, tokens_left, rows_left,
                                               kv_left)
            tokens_left, rows_left, allocation_failed = tokens_left - taken, rows_left - taken, allocation_failed or failed
            if kv_left is not None:
                kv_left -= reads
            continue
        if not in_margin and draft.chunks and request.status != RequestStatus.DECODING:
            continue
        start = request.num_computed
        count = chunk_size(request, start)
        if count == 0:
            continue
        if start + count > capacity:
            draft.fail(request_id, f"request {request_id!r} reached {capacity} tokens, the most one request "
                                   f"holds (num_blocks x block_size, or max_blocks_per_request x block_size)")
            continue
        grown = B.ensure_capacity(draft.alloc, request_id, start + count)
        while grown is None:
            victim = draft.victim(exclude=G.members_with(draft.groups, draft.member_of, request_id))
            if victim is None:
                break
            draft.preempt(victim)
            grown = B.ensure_capacity(draft.alloc, request_id, start + count)
        if grown is None:
            allocation_failed = True
            # Nothing else gives blocks back: this request waits for blocks, recomputed later.
            draft.preempt(request_id)
            continue
        draft.alloc = grown
        draft.add_chunk(request, start, count)
        tokens_left -= count
        if prefill_left is not None and request.status != RequestStatus.DECODING:
            prefill_left -= count
        rows_left -= 1
        if kv_left is not None:
            kv_left -= start + count

    for request_id in list(draft.waiting):
        if tokens_left == 0 or rows_left == 0 or (kv_left is not None and kv_left <= 0):
            break
        if request_id in draft.preempted or request_id in state.cancelled or request_id not in draft.waiting:
            continue  # (not waiting: admitted with its group's first member, or failed with it)
        if not in_margin and draft.chunks:
            break
        request = draft.requests[request_id]
        error = G.admission_error(draft, request_id, capacity)
        if error is not None:
            draft.fail(request_id, error)
            continue
        if not policy.chunked_prefill and request.num_tokens > max_batch_tokens:
            draft.fail(request_id, f"request {request_id!r} has {request.num_tokens} tokens to prefill, more than "
                                   f"the token budget ({max_batch_tokens}), and chunked prefill is off")
            continue
        trial, reused = draft.alloc, 0
        if policy.prefix_caching:
            # The last token is always computed: its logits give the next token.
            trial, reused = B.acquire_prefix(trial, request_id, request.token_ids, max_tokens=request.num_tokens - 1,
                                             salt=prefix_salt(request, policy.prefix_cache_boundary))
        count = chunk_size(request, reused)
        # A group member whose tokens but the last all came from the prefix cache is admitted
        # with nothing to compute: it waits for its group.
        grouped_and_cached = request_id in draft.member_of and reused == request.num_tokens - 1
        if count == 0 and not grouped_and_cached:
            break  # arrival order: a request waits rather than be overtaken by later ones
        trial = B.ensure_capacity(trial, request_id, reused + count)
        if trial is None:
            allocation_failed = True
            break
        draft.alloc = trial
        draft.waiting.remove(request_id)
        draft.active.append(request_id)
        G.admit_members(draft, request_id)
        request = request.replace(num_reused=reused)
        if count == 0:
            draft.requests[request_id] = request.replace(num_computed=reused, status=RequestStatus.PREFILLING)
            continue
        draft.requests[request_id] = request
        draft.add_chunk(request, reused, count)
        tokens_left -= count
        if prefill_left is not None:
            prefill_left -= count
        rows_left -= 1
        if kv_left is not None:
            kv_left -= reused + count

    if not draft.chunks:
        G.unstick(draft)
    return draft.finish(cache_full=allocation_failed)


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


def _as_tokens(request_id, value) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    try:
        return tuple(int(t) for t in value)
    except TypeError:
        raise TypeError(f"new tokens of request {request_id!r} must be an int or a sequence of ints, "
                        f"got {type(value).__name__}") from None


def _commit(state: SchedulerState, alloc: B.BlockAllocator, chunk: ScheduledChunk,
            request: RequestState) -> B.BlockAllocator:
    """Register the full blocks ``chunk`` completed in the prefix cache."""
    if state.policy.prefix_caching and chunk.end // alloc.block_size > len(alloc.chains.get(chunk.request_id, ())):
        alloc = B.commit_full_blocks(alloc, chunk.request_id, request.token_ids[:chunk.end],
                                     prefix_salt(request, state.policy.prefix_cache_boundary))
    return alloc


def apply_step(state: SchedulerState, batch: ScheduledBatch,
               new_tokens: Mapping[Hashable, int | Sequence[int]]) -> tuple[SchedulerState, tuple[RequestState, ...]]:
    """Record the forward of ``batch``: ``new_tokens[request_id]`` are the tokens sampled for
    each sampling chunk (one, or several when a step accepts several). Tokens past an EOS token
    or ``max_new_tokens`` are dropped. Chunks of requests ended meanwhile (cancelled) are skipped.

    Returns the new state and the requests that finished, with status FINISHED, in batch order.
    """
    requests = dict(state.requests)
    alloc = state.allocator
    finished = []
    for chunk in batch.chunks:
        request = requests.get(chunk.request_id)
        if request is None or request.num_computed < chunk.end:
            continue  # ended or preempted since it was scheduled
        if not chunk.samples:
            alloc = _commit(state, alloc, chunk, request)
            continue
        if chunk.request_id not in new_tokens:
            raise ValueError(f"`new_tokens` has no token for request {chunk.request_id!r}, whose chunk samples")
        room = None if request.max_new_tokens is None else request.max_new_tokens - len(request.generated_ids)
        taken, done = [], False
        for token in _as_tokens(chunk.request_id, new_tokens[chunk.request_id]):
            taken.append(token)
            if token in request.eos_token_ids or (room is not None and len(taken) >= room):
                done = True
                break
        request = request.replace(generated_ids=request.generated_ids + tuple(taken),
                                  status=RequestStatus.FINISHED if done else RequestStatus.DECODING)
        # After the new tokens: a chunk that kept speculative drafts wrote them past the old tokens.
        alloc = _commit(state, alloc, chunk, request)
        if done:
            alloc = B.free_request(alloc, chunk.request_id, keep_cached=state.policy.prefix_caching)
            del requests[chunk.request_id]
            finished.append(request)
        else:
            requests[chunk.request_id] = request
    done = {r.request_id for r in finished}
    state = state.replace(
        allocator=alloc,
        requests=MappingProxyType(requests),
        active=tuple(r for r in state.active if r not in done) if done else state.active,
    )
    return state, tuple(finished)
