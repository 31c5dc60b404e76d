"""A request's ``num_return_sequences`` (OpenAI's ``n``) in continuous batching: the prompt is computed once.

A request with ``n`` sequences is admitted as its first sequence, the *leader*, which carries the
others (``SEQUENCES_KEY`` in its ``RequestState.settings``) until its prompt is computed. In the
step whose chunk ends the prompt (the leader's first sampling chunk), :func:`add_sequences` forks
the leader's block table into each other sequence with the beam groups' fork (``blocks.fork``:
the full blocks shared by reference count, the partial last block copied in the paged cache
after the forward, ``Engine.copy_blocks``) and gives each a *shared row*: a chunk without tokens
whose logits are the leader's at the prompt's last token (``ScheduledChunk.logits_from``,
gathered by :func:`shared_logits`). Each row then chooses its first token with its own
processors and key, so sequence ``j`` gets what ``generate`` samples for the prompt's ``j``-th
returned row, and the prompt's tokens go through the model once.

From there the sequences are independent requests: each decodes, ends (EOS, its length, a stop
string), is cancelled and is preempted alone; a preempted sequence recomputes its tokens (the
prompt's full blocks from the prefix cache) and goes on with its own key, so its tokens do not
change. They need no gang: a beam group's members decode together because one beam step reads
all their logits (``genfn.batching.groups``), while a sequence's token depends on its own logits
and key only. A sequence that finds no row left in the batch, or no block for its copy, joins as
a request that computes the rest of the prompt itself (the full blocks still shared). Under
classifier-free guidance the leader's group forks along: each sequence gets its own unconditional
request (``genfn.batching.guidance_groups``), forked from the leader's and sharing its row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from types import MappingProxyType

import torch

from genfn.batching import blocks as B
from genfn.batching import groups as G
from genfn.batching import guidance_groups as GG
from genfn.batching import scheduling as S
from genfn.batching.requests import RequestState, RequestStatus

__all__ = ["SEQUENCES_KEY", "Joined", "add_sequences", "computed_chunks", "leader_request", "shared_logits"]

# The key of a leader's other sequences (a tuple of RequestState) in its RequestState.settings.
SEQUENCES_KEY = "genfn.sequences"


@dataclasses.dataclass(frozen=True)
class Joined:
    """What :func:`add_sequences` did in a step: ``leaders``, the requests whose other sequences
    entered the scheduler; ``copies``, the ``(source, target)`` blocks to copy after the forward."""

    leaders: tuple[Hashable, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()


def leader_request(sequences: Sequence[RequestState]) -> RequestState:
    """The one request a request's sequences are admitted as: the first, carrying the others."""
    first, rest = sequences[0], tuple(sequences[1:])
    if not rest:
        return first
    return first.replace(settings=MappingProxyType({**first.settings, SEQUENCES_KEY: rest}))


def add_sequences(state: S.SchedulerState, batch: S.ScheduledBatch, max_rows: int
                  ) -> tuple[S.SchedulerState, S.ScheduledBatch, Joined]:
    """Fork the leaders whose chunk in ``batch`` ends their prompt into their other sequences (see
    the module docstring); ``max_rows``: the most rows (chunks) a forward takes."""
    leaders = [c for c in batch.chunks if c.samples and SEQUENCES_KEY in state.requests[c.request_id].settings]
    if not leaders:
        return state, batch, Joined()
    alloc, requests, active, arrivals = state.allocator, dict(state.requests), list(state.active), state.arrivals
    groups = dict(state.groups)
    chunks, copies = list(batch.chunks), []
    for chunk in leaders:
        leader = requests[chunk.request_id]
        settings = dict(leader.settings)
        others = settings.pop(SEQUENCES_KEY)
        requests[leader.request_id] = leader.replace(settings=MappingProxyType(settings))
        # The leader's group (CFG's unconditional request beside it) forks along: member i of each
        # sequence's group continues member i of the leader's.
        sources = groups[leader.request_id].members if leader.request_id in groups else (leader.request_id,)
        for sequence in others:
            sequence, partner = GG.split_partner(sequence)
            members = (sequence,) if partner is None else (sequence, partner)
            if len(members) != len(sources):
                raise ValueError(f"request {sequence.request_id!r} and its first sequence differ in their groups")
            if any(m.request_id in requests for m in members):
                raise ValueError(f"request id {sequence.request_id!r} is already in the scheduler")
            # With rows for its group, a sequence shares its leader's logits; else it computes at
            # least the last token itself (tokens: the source's, none generated yet).
            row = len(chunks) + len(members) <= max_rows
            trial, forked = _fork(alloc, sources, members, requests, whole=row)
            shared = row and all(computed == requests[s].num_tokens for s, (_, computed, _) in zip(sources, forked))
            if row and not shared:  # a block short for a copy: the whole group computes its last tokens
                trial, forked = _fork(alloc, sources, members, requests, whole=False)
            alloc = trial
            for source, (member, computed, copy) in zip(sources, forked):
                if copy is not None:
                    copies.append(copy)
                requests[member.request_id] = member.replace(
                    status=RequestStatus.DECODING if shared else RequestStatus.PREFILLING, num_computed=computed,
                    num_reused=computed, arrival=arrivals)
                arrivals += 1
                active.append(member.request_id)
                if shared:
                    chunks.append(S.ScheduledChunk(member.request_id, computed, (), True,
                                                   prompt_len=len(member.prompt_ids), logits_from=source))
            if partner is not None:
                groups[sequence.request_id] = G.RequestGroup(tuple(m.request_id for m in members))
    state = state.replace(allocator=alloc, requests=MappingProxyType(requests), active=tuple(active),
                          arrivals=arrivals, groups=MappingProxyType(groups))
    joined = Joined(tuple(c.request_id for c in leaders), tuple(copies))
    return state, dataclasses.replace(batch, chunks=tuple(chunks)), joined


def _fork(alloc, sources, members, requests, whole: bool):
    """``(alloc, [(member, tokens kept, copy)])``: each member's table forked from its source's
    tokens (all of them when ``whole``, else all but the last)."""
    forked = []
    for source, member in zip(sources, members):
        count = requests[source].num_tokens - (0 if whole else 1)
        alloc, computed, copy = B.fork(alloc, source, member.request_id, count)
        forked.append((member, computed, copy))
    return alloc, forked


def computed_chunks(batch: S.ScheduledBatch) -> S.ScheduledBatch:
    """``batch`` without its shared rows: the chunks the forward computes (shared rows come last,
    so every other chunk keeps its row)."""
    if all(c.logits_from is None for c in batch.chunks):
        return batch
    return dataclasses.replace(batch, chunks=tuple(c for c in batch.chunks if c.logits_from is None))


def shared_logits(batch: S.ScheduledBatch, logits: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The rows' logits ``[R, V]`` from the forward's ``logits [R + E, V]`` (``num_rows``: ``R``):
    a shared row takes its leader's at the prompt's last token (the leader's row, or, when the
    leader's chunk drafted, its first drafted-position entry, ``BatchInputs.logits_index``)."""
    if all(c.logits_from is None for c in batch.chunks):
        return logits[:num_rows]
    where, extra = {}, num_rows
    for row, chunk in enumerate(batch.chunks):
        where[chunk.request_id] = extra if chunk.num_drafts else row
        extra += chunk.num_drafts
    index = [where[c.logits_from] if c.logits_from is not None else row for row, c in enumerate(batch.chunks)]
    index += range(len(index), num_rows)
    return logits.index_select(0, torch.tensor(index, dtype=torch.int64, device=logits.device))
