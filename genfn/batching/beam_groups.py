"""Beam search and beam sampling inside continuous batching: a request's beams are rows of the batch.

A beam request is admitted as one request (its *leader*), so its prompt is prefilled once. When
the leader's prompt is computed, the engine step hands its logits row to ``advance``, which takes
the first beam step (``genfn.strategies.beam.select_beams``, the very step ``generate`` runs, on
the row repeated ``K`` times with only the first beam alive, as ``generate``'s ``K`` identical
prefilled rows) and forks the leader into ``K`` member requests, a ``RequestGroup``
(``genfn.batching.groups``): the scheduler then gives all ``K`` members their one-token chunk in
the same forward or none. After each forward, the group's ``K`` logits rows take the next beam
step; each new beam follows its parent: its tokens become the parent's plus its new token, and
its block table a copy-on-write fork of the parent's (``blocks.fork``: full blocks shared by
reference count, the partial last block copied in the paged cache). A parent's first child takes
its table as it is; a parent no beam continues releases its blocks (which makes room for the
copies: a step copies at most as many blocks as it drops). When the search is done, the group
ends and its best ``num_return_sequences`` hypotheses come back as the request's sequences, each
with its ``sequence_score`` (``generate``'s ``sequences_scores``).

Beams never stream (as in ``generate``); stop strings, structured outputs and ``top_logprobs``
are refused for beam requests when they are resolved (``batching.settings``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from types import MappingProxyType

import torch

from genfn.batching import blocks as B
from genfn.batching import groups as G
from genfn.batching import scheduling as S
from genfn.batching.requests import RequestState, RequestStatus, make_request, prefix_salt
from genfn.state.beam import BeamState
from genfn.strategies.beam import select_beams

__all__ = ["BEAM_KEY", "BeamRequest", "BeamSteps", "advance", "check_beams_fit", "leader_request", "member_ids"]

# The key of a beam request's ``BeamRequest`` in its ``RequestState.settings``.
BEAM_KEY = "genfn.beam"


@dataclasses.dataclass(frozen=True)
class BeamRequest:
    """A beam request's search: ``state`` its beam buffers (one prompt, ``K`` beams, no cache),
    ``sequence_ids`` the ids its returned hypotheses are delivered under, best first."""

    state: BeamState
    sequence_ids: tuple[Hashable, ...]


@dataclasses.dataclass(frozen=True)
class BeamSteps:
    """What ``advance`` did in one engine step: ``rows``, the requests whose sampling chunks it
    consumed (the rest of the step must not apply them); ``finished``, one FINISHED request per
    returned hypothesis, with ``scores`` by id; ``failed``, the groups that saw NaN/inf logits."""

    rows: frozenset = frozenset()
    finished: tuple[RequestState, ...] = ()
    scores: Mapping[Hashable, float] = dataclasses.field(default_factory=dict)
    failed: tuple[RequestState, ...] = ()

    def rest(self, batch: S.ScheduledBatch) -> S.ScheduledBatch:
        """``batch`` without the sampling chunks handled here."""
        if not self.rows:
            return batch
        return dataclasses.replace(batch, chunks=tuple(c for c in batch.chunks
                                                       if not (c.samples and c.request_id in self.rows)))


def leader_request(request_id: Hashable, prompt_ids, settings, beam: BeamState,
                   sequence_ids: tuple[Hashable, ...]) -> RequestState:
    """The one request a beam request is admitted as: it prefills the prompt, then forks into the
    beams. No EOS id and no token limit of its own: the search decides when the group ends.
    ``settings``: its ``RequestSettings``; ``sequence_ids``: one id per returned hypothesis."""
    return make_request(request_id, prompt_ids, None, None, {"genfn": settings,
                                                             BEAM_KEY: BeamRequest(beam, tuple(sequence_ids))})


def check_beams_fit(num_beams: int, max_requests_per_batch: int, max_batch_tokens: int) -> None:
    """A ValueError unless a request's ``num_beams`` beams fit one forward (they decode together)."""
    most = min(max_requests_per_batch, max_batch_tokens)
    if num_beams > most:
        raise ValueError(f"`num_beams` ({num_beams}) must be <= {most}: a request's beams decode in one forward "
                         f"(max_requests_per_batch={max_requests_per_batch}, max_batch_tokens={max_batch_tokens})")


def member_ids(group_id: Hashable, num_beams: int) -> tuple[Hashable, ...]:
    """The group's member ids: the request's own id (beam 0), then ``(id, "beam", j)``."""
    return (group_id,) + tuple((group_id, "beam", j) for j in range(1, num_beams))


def advance(engine, state: S.SchedulerState, batch: S.ScheduledBatch, logits: torch.Tensor
            ) -> tuple[S.SchedulerState, BeamSteps]:
    """Take the beam step of every beam group whose rows sampled in ``batch`` (``logits``: the
    forward's ``[rows, V]``, row ``i`` for chunk ``i``); ends the groups that are done."""
    rows = {c.request_id: i for i, c in enumerate(batch.chunks) if c.samples}
    searches = []
    member_of = G.member_index(state.groups) if state.groups else {}
    for request_id in rows:
        request = state.requests.get(request_id)
        if request is None or BEAM_KEY not in request.settings:
            continue
        gid = member_of.get(request_id, request_id)
        if gid not in searches:
            searches.append(gid)
    if not searches:
        return state, BeamSteps()
    consumed, finished, failed, scores = set(), [], [], {}
    for gid in searches:
        group = state.groups.get(gid)
        members = group.members if group is not None else (gid,)
        missing = [m for m in members if m not in rows]
        if missing:
            raise AssertionError(f"beam group {gid!r} sampled without its members {missing!r}")
        consumed.update(members)
        state, ended = _step_group(engine, state, batch, gid, members, [rows[m] for m in members], logits)
        for request, score in ended:
            (failed if request.status == RequestStatus.FAILED else finished).append(request)
            if score is not None:
                scores[request.request_id] = score
    return state, BeamSteps(frozenset(consumed), tuple(finished), scores, tuple(failed))


def _step_group(engine, state, batch, gid, members, rows, logits):
    """One beam step of group ``gid``; returns the state and the requests it ended, each with
    its score (``[]`` while the search goes on)."""
    leader = state.requests[members[0]]
    search: BeamRequest = (state.groups[gid].payload if gid in state.groups else leader.settings[BEAM_KEY])
    beam = search.state
    num_beams = beam.num_beams
    block = logits[rows[0]].unsqueeze(0).expand(num_beams, -1) if len(members) == 1 else logits[rows]
    if state.policy.prefix_caching:
        state = _commit(state, batch, members)
    column = leader.num_tokens  # every member holds the same number of tokens: the new ones go here
    beam, beam_idx = select_beams(beam, block)
    # The group's one host sync: NaN/inf seen, search done, each new beam's parent and token.
    nonfinite, done, *rest = torch.cat((beam.nonfinite.any().reshape(1), beam.done.reshape(1), beam_idx,
                                        beam.running_sequences[0, :, column])).tolist()
    if nonfinite and beam.options.check_finite:
        return _fail(engine, state, gid, members)
    if done:
        return _finish(state, gid, beam, search)
    parents, tokens = rest[:num_beams], rest[num_beams:]
    state = _fork(engine, state, gid, members, parents, tokens, dataclasses.replace(search, state=beam))
    return state, []


def _commit(state: S.SchedulerState, batch: S.ScheduledBatch, members) -> S.SchedulerState:
    """Register the members' newly filled blocks in the prefix cache (``apply_step``'s work for
    the chunks ``advance`` consumes)."""
    alloc = state.allocator
    for chunk in batch.chunks:
        if chunk.request_id in members and chunk.samples:
            request = state.requests[chunk.request_id]
            alloc = B.commit_full_blocks(alloc, chunk.request_id, request.token_ids[:chunk.end],
                                         prefix_salt(request, state.policy.prefix_cache_boundary))
    return state.replace(allocator=alloc)


def _fail(engine, state, gid, members):
    """End the group FAILED: NaN/inf logits. Its blocks no other request holds are zeroed, as
    ``engine.fail_nonfinite`` does for a request alone (a stale NaN slot poisons a masked read)."""
    orphaned = B.held_only_by(state.allocator, members)
    error = (f"NonFiniteLogitsError: the model produced NaN or infinite logits for request {gid!r}; pass "
             f"remove_invalid_values=True to replace them and keep generating, or check the model's weights and dtype")
    state, ended = S.finish(state, gid, RequestStatus.FAILED, error, keep_cached=False)
    engine.clear_blocks(orphaned)
    return state, [(ended, None)]


def _finish(state, gid, beam: BeamState, search: BeamRequest):
    """End the group; its best hypotheses as FINISHED requests (generated tokens only) with their scores."""
    count = len(search.sequence_ids)
    prompt = state.requests[gid].prompt_ids
    sequences = beam.sequences[0, :count].tolist()
    lengths = (beam.beam_indices[0, :count] != -1).sum(dim=-1).tolist()
    scores = beam.beam_scores[0, :count].tolist()
    state, _ = S.finish(state, gid)
    eos = frozenset(beam.options.eos_token_ids)
    return state, [(RequestState(request_id=sid, prompt_ids=prompt,
                                 generated_ids=tuple(sequences[j][len(prompt):len(prompt) + lengths[j]]),
                                 eos_token_ids=eos, status=RequestStatus.FINISHED), scores[j])
                   for j, sid in enumerate(search.sequence_ids)]


def _fork(engine, state: S.SchedulerState, gid, members, parents, tokens, search: BeamRequest) -> S.SchedulerState:
    """New beam ``j`` continues old member ``parents[j]`` with ``tokens[j]``: its tokens, its table."""
    ids = member_ids(gid, len(parents))
    parked = {member: ("genfn.beam.parent", gid, i) for i, member in enumerate(members)}
    alloc = B.rename(state.allocator, parked)
    keep_cached = state.policy.prefix_caching
    for i, member in enumerate(members):
        if i not in parents:  # no beam continues it: its blocks make room for the copies below
            alloc = B.free_request(alloc, parked[member], keep_cached=keep_cached)
    first_child = {}
    for j, parent in enumerate(parents):
        first_child.setdefault(parent, j)
    computed = {}
    copies = []
    for j, parent in enumerate(parents):
        source = state.requests[members[parent]]
        if first_child[parent] == j:
            computed[j] = source.num_computed
            continue
        alloc, computed[j], copy = B.fork(alloc, parked[members[parent]], ids[j], source.num_computed)
        if copy is not None:
            copies.append(copy)
    alloc = B.rename(alloc, {parked[members[parent]]: ids[j] for parent, j in first_child.items()})
    engine.copy_blocks(copies)
    requests = {rid: r for rid, r in state.requests.items() if rid not in parked}
    for j, parent in enumerate(parents):
        source = state.requests[members[parent]]
        status = RequestStatus.DECODING if computed[j] == source.num_tokens else RequestStatus.PREFILLING
        requests[ids[j]] = source.replace(request_id=ids[j], generated_ids=source.generated_ids + (tokens[j],),
                                          num_computed=computed[j], status=status)
    at = min(state.active.index(m) for m in members)
    active = [r for r in state.active if r not in parked]
    active[at:at] = ids
    groups = {**state.groups, gid: G.RequestGroup(ids, search)}
    return state.replace(allocator=alloc, requests=MappingProxyType(requests), active=tuple(active),
                         groups=MappingProxyType(groups))
