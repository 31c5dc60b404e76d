"""Requests that decode together, as scheduling sees them: a beam search's beams, a guided request
and its unconditional request (``genfn.batching.guidance_groups``).

A ``RequestGroup``'s members are requests of their own (each its tokens, its block table), and
the group's next tokens come from all of their logits at once, so ``schedule`` treats them as a
gang: every member gets its one-token sampling chunk in the same batch, or none does; a member
never samples alone (a member recomputed after preemption computes up to, not including, its
last token, then waits for the others); admitting a member admits the others (``admit_members``:
a group half admitted could wait forever for blocks its own members hold); preempting a member
sends back every member not in the batch being built; ending one (cancelled, failed, finished)
ends them all. ``payload`` is the
owner's state (beam search: ``genfn.batching.beam_groups.BeamRequest``), opaque here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

from genfn.batching import blocks as B
from genfn.batching.requests import RequestState, RequestStatus, prefix_salt

__all__ = ["RequestGroup", "add_group", "admission_error", "admit_members", "group_ready", "last_to_compute",
           "member_index", "members_with", "unstick"]


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


def admission_error(draft, request_id: Hashable, capacity: int) -> str | None:
    """Why ``request_id`` can never run (``None`` when it can): it holds more than ``capacity``
    tokens, or its group needs more blocks at once than the cache has (members share only the
    full blocks of their common prefix)."""
    request = draft.requests[request_id]
    if request.num_tokens > capacity:
        return (f"request {request_id!r} has {request.num_tokens} tokens; one request holds at most {capacity} "
                f"(num_blocks x block_size, or max_blocks_per_request x block_size)")
    members = members_with(draft.groups, draft.member_of, request_id)
    if len(members) == 1:
        return None
    alloc = draft.alloc
    tokens = [draft.requests[m].token_ids for m in members]
    common = next((i for i, column in enumerate(zip(*tokens)) if len(set(column)) > 1), min(map(len, tokens)))
    shared = common // alloc.block_size
    blocks = shared + sum(-(-len(t) // alloc.block_size) - shared for t in tokens)
    if blocks <= alloc.num_blocks:
        return None
    return (f"request {members[0]!r} and the {len(members) - 1} other request(s) it decodes with need {blocks} blocks "
            f"at once, more than the cache's {alloc.num_blocks}")


def admit_members(draft, request_id: Hashable) -> None:
    """Admit the other waiting members of ``request_id``'s group beside it (just admitted), with
    nothing to compute in this batch: they take their cached prefix and no new block, so this
    never fails, and they compute their tokens from the next batch on."""
    for member in members_with(draft.groups, draft.member_of, request_id):
        if member == request_id or member not in draft.waiting:
            continue
        request, reused = draft.requests[member], 0
        if draft.state.policy.prefix_caching:
            draft.alloc, reused = B.acquire_prefix(draft.alloc, member, request.token_ids,
                                                   max_tokens=request.num_tokens - 1,
                                                   salt=prefix_salt(request, draft.state.policy.prefix_cache_boundary))
        draft.alloc = B.ensure_capacity(draft.alloc, member, reused)
        draft.waiting.remove(member)
        draft.active.append(member)
        draft.requests[member] = request.replace(num_reused=reused, num_computed=reused,
                                                 status=RequestStatus.PREFILLING)


def unstick(draft) -> None:
    """A batch that got no chunk may be stuck on a group split by preemption: members admitted,
    holding blocks and waiting for a member that waits for blocks. Send the first such group's
    admitted members back (their blocks free; the group is then admitted whole, ``admit_members``)."""
    for group in draft.groups.values():
        if any(m in draft.waiting for m in group.members) and any(m in draft.active for m in group.members):
            draft.preempt(next(m for m in group.members if m in draft.active))
            return
