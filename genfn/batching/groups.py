"""Requests that decode together, as scheduling sees them: a beam search's beams.

A ``RequestGroup``'s members are requests of their own (each its tokens, its block table), and
the group's next tokens come from all of their logits at once, so ``schedule`` treats them as a
gang: every member gets its one-token sampling chunk in the same batch, or none does; a member
never samples alone (a member recomputed after preemption computes up to, not including, its
last token, then waits for the others); preempting a member sends back every member not in the
batch being built; ending one (cancelled, failed, finished) ends them all. ``payload`` is the
owner's state (beam search: ``genfn.batching.beam_groups.BeamRequest``), opaque here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

from genfn.batching import blocks as B
from genfn.batching.requests import RequestState

__all__ = ["RequestGroup", "add_group", "group_ready", "last_to_compute", "member_index", "members_with"]


@dataclasses.dataclass(frozen=True)
class RequestGroup:
    """``members``: the request ids of the group, in row order (the first is the group's id)."""

    members: tuple[Hashable, ...]
    payload: Any = None


def member_index(groups: Mapping[Hashable, RequestGroup]) -> dict[Hashable, Hashable]:
    """member id -> its group's id."""
    return {member: gid for gid, group in groups.items() for member in group.members}


def members_with(groups: Mapping[Hashable, RequestGroup], member_of: Mapping[Hashable, Hashable],
                 request_id: Hashable) -> tuple[Hashable, ...]:
    """The request and the other members of its group (just the request when it has none)."""
    gid = member_of.get(request_id)
    return (request_id,) if gid is None else groups[gid].members


def last_to_compute(request: RequestState, grouped: bool) -> int:
    """How far a chunk of ``request`` may reach: its last token for a request alone (that chunk
    samples), one short of it for a group member (its group samples all its members at once)."""
    return request.num_tokens - 1 if grouped else request.num_tokens


def group_ready(group: RequestGroup, requests: Mapping[Hashable, RequestState], active, in_batch) -> bool:
    """Every member is admitted, has only its last token to compute, and has no chunk yet in this batch."""
    return all(m in active and m not in in_batch and requests[m].remaining == 1 for m in group.members)


def add_group(draft, members: tuple[Hashable, ...], capacity: int, tokens_left: int, rows_left: int,
              kv_left: int | None) -> tuple[int, int, bool]:
    """Give every member of a ready group its one-token sampling chunk in ``draft`` (the batch
    ``scheduling.schedule`` builds), or none: blocks come from other requests (preempted), else the
    whole group waits. Returns (chunks added, key/value positions they read, blocks ran out)."""
    reads = sum(draft.requests[m].num_tokens for m in members)
    if tokens_left < len(members) or rows_left < len(members) or (kv_left is not None and kv_left < reads):
        return 0, 0, False
    if max(draft.requests[m].num_tokens for m in members) > capacity:
        draft.fail(members[0], f"request {members[0]!r} reached {capacity} tokens, the most one request holds "
                               f"(num_blocks x block_size, or max_blocks_per_request x block_size)")
        return 0, 0, False
    need = sum(B.blocks_needed(draft.alloc, m, draft.requests[m].num_tokens) for m in members)
    while B.num_free_blocks(draft.alloc) < need:
        victim = draft.victim(exclude=members)
        if victim is None:
            draft.preempt(members[0])
            return 0, 0, True
        draft.preempt(victim)
    for member in members:
        request = draft.requests[member]
        draft.alloc = B.ensure_capacity(draft.alloc, member, request.num_tokens)
        draft.add_chunk(request, request.num_computed, 1)
    return len(members), reads, False
