"""Speculation inside continuous batching: a step appends 0..k+1 tokens to a row.

A request resolved with ``prompt_lookup_num_tokens=k``, ``assistant_model`` or
``assistant_early_exit`` carries a ``Speculation`` in its ``RequestSettings``. The engine step
(``genfn.batching.engine.engine_step``) calls four hooks:

``schedule_budget``
    the token budget ``schedule`` gets: the whole budget less room for the drafts of the
    speculative requests decoding now (at most half of it), so prefill cannot crowd them out.
``add_drafts``
    after ``schedule``: each sampling chunk of a speculative request gets up to ``k`` drafts
    after its last token, within the request's ``max_new_tokens``, the block-table width, the
    token budget left and the free blocks (drafts never preempt anyone: a row that finds no block
    drafts nothing). Prompt lookup proposes them from the request's own tokens with the proposer
    ``generate`` uses (``PromptLookupDrafter``), a fresh block every step; a model drafter
    (``genfn.batching.drafting``) feeds the drafts of the round it is in. Under a
    ``response_format``, drafts are cut at the first token the request's grammar refuses.
``verify_drafts``
    after the forward, which gave logits at the row's last token and at every draft
    (``BatchInputs.logits_index``): the drafted rows' ``[S, k + 1, V]`` block goes through the
    grammar masks along the drafts and the requests' processors position by position
    (``process_block``) and is verified by ``verify_greedy`` / ``verify_sampling`` (prompt lookup
    by matching: it has no draft distribution, so a sampled row takes exactly the tokens plain
    keyed sampling takes; a model drafter with its drafts' probabilities, as ``generate``
    verifies them), then cut at the first EOS, at ``max_new_tokens`` (``limit_new_tokens``) and
    after the first token whose text ends with a stop string. The kept drafts plus the target's
    own next token are the row's new tokens.
``rewind``
    before ``apply_step``: a drafted chunk is cut back to the tokens kept, the request's computed
    count to its kept tokens and its blocks past them released (``blocks.truncate``), so a
    rejected draft's keys/values slots are overwritten later and never read (attention stops at
    ``kv_lens``).

So a greedy request gives the tokens it gives without speculation, and a sampled one the tokens
``generate`` gives with the same settings and key; only the number of forwards changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from types import MappingProxyType

import torch

from genfn.batching import blocks as B
from genfn.batching import drafting as D
from genfn.batching import scheduling as S
from genfn.batching.inputs import build_row_history
from genfn.batching.requests import RequestState, RequestStatus
from genfn.processors.chain import ProcessorChain
from genfn.processors.grammar import FREE_ROW, apply_token_bitmask
from genfn.processors.numerics import nonfinite_rows
from genfn.strategies.assisted.drafter import DraftInput, PromptLookupDrafter
from genfn.strategies.assisted.verify import Verified, limit_new_tokens, process_block, verify_greedy, verify_sampling
from genfn.strategies.token_choice import chosen_logprobs, raw_logprobs, top_logprobs, top_pairs

__all__ = ["Speculation", "add_drafts", "rewind", "schedule_budget", "speculation_of", "verify_drafts"]


@dataclasses.dataclass(frozen=True)
class Speculation:
    """A request's speculation: its prompt-lookup ``drafter`` (``k = drafter.num_tokens``), or
    ``rounds``: one sequence's model drafter and its round (``genfn.batching.drafting``)."""

    drafter: PromptLookupDrafter | None = None
    rounds: D.DraftRounds | None = None

    @property
    def num_tokens(self) -> int:
        return self.rounds.num_tokens if self.rounds is not None else self.drafter.num_tokens


def _settings(request: RequestState):
    # RequestSettings live in genfn.batching.engine, which imports this module: read them by key.
    return request.settings.get("genfn")


def speculation_of(request: RequestState) -> Speculation | None:
    return getattr(_settings(request), "speculation", None)


def schedule_budget(state: S.SchedulerState, token_budget: int) -> int:
    """The budget ``schedule`` gets: ``token_budget`` less the drafts of the decoding speculative
    requests (at most half of it, so prefill keeps moving)."""
    reserve = 0
    for request_id in state.active:
        request = state.requests[request_id]
        spec = speculation_of(request)
        if spec is not None and request.status == RequestStatus.DECODING:
            reserve += spec.num_tokens
    return token_budget - min(reserve, token_budget // 2) if reserve else token_budget


def _room(request: RequestState, max_len: int) -> int:
    """Drafts the request may take: the target's own token must still fit after them."""
    room = max_len - request.num_tokens
    if request.max_new_tokens is not None:
        room = min(room, request.max_new_tokens - len(request.generated_ids))
    return max(room - 1, 0)


def _propose(rows: list[tuple[RequestState, Speculation, int]]) -> list[tuple[int, ...]]:
    """Each row's drafts (at most its budget), by its drafter, rows with the same drafter at once."""
    drafts: list[tuple[int, ...]] = [()] * len(rows)
    groups: dict[PromptLookupDrafter, list[int]] = {}
    for index, (_, spec, _) in enumerate(rows):
        groups.setdefault(spec.drafter, []).append(index)
    for drafter, indices in groups.items():
        width = max(rows[i][0].num_tokens for i in indices)
        tokens = torch.zeros(len(indices), width, dtype=torch.int64)
        for line, i in enumerate(indices):
            request = rows[i][0]
            tokens[line, :request.num_tokens] = torch.tensor(request.token_ids, dtype=torch.int64)
        cur_len = torch.tensor([rows[i][0].num_tokens for i in indices], dtype=torch.int64)
        budget = torch.tensor([rows[i][2] for i in indices], dtype=torch.int64)
        draft, _ = drafter.propose(None, DraftInput(tokens=tokens, cur_len=cur_len, budget=budget))
        for line, (i, valid) in enumerate(zip(indices, draft.num_valid.tolist())):
            drafts[i] = tuple(draft.tokens[line, :valid].tolist())
    return drafts


def add_drafts(state: S.SchedulerState, batch: S.ScheduledBatch, *, token_budget: int, max_len: int, model=None
               ) -> tuple[S.SchedulerState, S.ScheduledBatch]:
    """Append drafts to the sampling chunks of speculative requests (see the module docstring).
    ``token_budget``: the most tokens the forward takes; ``max_len``: the most one request holds;
    ``model``: the model a model drafter drafts for (early exit runs its first layers)."""
    lookup, proposed = [], []
    for index, chunk in enumerate(batch.chunks):
        request = state.requests[chunk.request_id]
        spec = speculation_of(request) if chunk.samples else None
        if spec is None:
            continue
        room = _room(request, max_len)
        if spec.rounds is not None:
            drafts = D.round_drafts(model, request, _settings(request), spec.rounds, room)
            if drafts:
                proposed.append((index, request, drafts))
        elif min(spec.num_tokens, room) > 0:
            lookup.append((request, spec, min(spec.num_tokens, room), index))
    for (request, _, _, index), draft in zip(lookup, _propose([row[:3] for row in lookup]) if lookup else ()):
        grammar = _settings(request).grammar
        if grammar is not None and draft:
            draft = draft[:D.grammar_cut(grammar, request, list(draft))]
        proposed.append((index, request, draft))
    if not proposed:
        return state, batch
    tokens_left = token_budget - batch.num_tokens
    alloc, chunks = state.allocator, list(batch.chunks)
    for index, request, draft in sorted(proposed, key=lambda row: row[0]):  # in chunk order
        draft = draft[:max(tokens_left, 0)]
        if not draft:
            continue
        grown = B.ensure_capacity(alloc, request.request_id, request.num_tokens + len(draft))
        if grown is None:  # no free block: the row drafts within its blocks rather than preempt anyone
            draft = draft[:len(B.block_table(alloc, request.request_id)) * alloc.block_size - request.num_tokens]
            if not draft:
                continue
        else:
            alloc = grown
        chunk = chunks[index]
        chunks[index] = dataclasses.replace(chunk, token_ids=chunk.token_ids + tuple(draft), num_drafts=len(draft))
        tokens_left -= len(draft)
    return state.replace(allocator=alloc), dataclasses.replace(batch, chunks=tuple(chunks))


def _merged_chain(settings: list, device) -> ProcessorChain | None:
    if all(s.chain is None for s in settings):
        return None
    empty = ProcessorChain(())
    return ProcessorChain.merge_rows([s.chain if s.chain is not None else empty for s in settings], device=device)


def _verify(drafts: torch.Tensor, num_valid: torch.Tensor, scores: torch.Tensor, settings: list,
            counter: torch.Tensor) -> Verified:
    """Greedy rows by ``verify_greedy``, sampling rows by ``verify_sampling`` with their keys."""
    verified = verify_greedy(drafts, num_valid, scores)
    sampling = [s.do_sample for s in settings]
    if not any(sampling):
        return verified
    zero = torch.zeros(2, dtype=torch.int64)
    keys = torch.stack([s.key.cpu() if s.do_sample else zero for s in settings]).to(scores.device)
    sampled = verify_sampling(drafts, num_valid, scores, keys, counter)
    rows = torch.tensor(sampling, dtype=torch.bool, device=scores.device)
    return Verified(tokens=torch.where(rows.unsqueeze(1), sampled.tokens, verified.tokens),
                    num_new=torch.where(rows, sampled.num_new, verified.num_new),
                    accepted=torch.where(rows, sampled.accepted, verified.accepted))


def _limit(verified: Verified, requests: list[RequestState], device) -> Verified:
    """``limit_new_tokens`` per row: cut after the first EOS (each request's own) and at its budget."""
    budget = torch.tensor([r.max_new_tokens - len(r.generated_ids) if r.max_new_tokens is not None else 1 << 30
                           for r in requests], dtype=torch.int64, device=device)
    eos_sets = sorted({tuple(sorted(r.eos_token_ids)) for r in requests})
    if len(eos_sets) == 1:
        return limit_new_tokens(verified, budget, eos_sets[0])
    num_new = verified.num_new
    for eos in eos_sets:
        rows = torch.tensor([tuple(sorted(r.eos_token_ids)) == eos for r in requests], device=device)
        num_new = torch.where(rows, limit_new_tokens(verified, budget, eos).num_new, num_new)
    return Verified(tokens=verified.tokens, num_new=num_new,
                    accepted=torch.minimum(verified.accepted, (num_new - 1).clamp(min=0)))


def _stop_cut(request: RequestState, tokens: list[int], device) -> int:
    """How many of ``tokens`` (appended to ``request``) stay: up to the first whose text ends with
    one of the request's stop strings, where plain decoding would have stopped."""
    matcher = _settings(request).stop_strings
    if matcher is None or len(tokens) < 2:
        return len(tokens)
    full = torch.tensor([request.token_ids + tuple(tokens)], dtype=torch.int64, device=device)
    ends = torch.arange(request.num_tokens + 1, full.shape[1] + 1, device=device)
    hits = matcher(full.expand(len(tokens), -1), ends).tolist()
    return hits.index(True) + 1 if True in hits else len(tokens)


def _to_verify(request: RequestState, chunk: S.ScheduledChunk) -> tuple[int, ...] | None:
    """The drafts the chunk's logits verify: prompt lookup's fed drafts; a model drafter's next
    ``num_drafts + 1`` drafts of its round (the row's own logits verify one more than it fed)."""
    spec = speculation_of(request)
    rounds = spec.rounds if spec is not None else None
    if rounds is not None:
        return rounds.drafts[:chunk.num_drafts + 1] if chunk.samples and rounds.active else None
    return chunk.token_ids[len(chunk.token_ids) - chunk.num_drafts:] if chunk.num_drafts else None


def _grammar_masked(block: torch.Tensor, rows: list[RequestState], settings: list, drafts: list) -> torch.Tensor:
    """``block`` with each constrained row's positions masked by its grammar along its drafts, as
    ``generate`` masks a speculative block (the raw block stays for logprobs and finiteness)."""
    if all(s.grammar is None for s in settings):
        return block
    width = next(s.grammar.width for s in settings if s.grammar is not None)
    masks = torch.full((*block.shape[:2], width), FREE_ROW, dtype=torch.int32)
    for line, (request, s) in enumerate(zip(rows, settings)):
        if s.grammar is not None:
            s.grammar.sync(0, request.generated_ids)
            if not s.grammar.finished[0]:
                s.grammar.walk_drafts(0, list(drafts[line]), masks[line])
    return apply_token_bitmask(block, masks.to(block.device))


def _verify_model_rows(verified: Verified, scores: torch.Tensor, drafted: list, settings: list,
                       counter: torch.Tensor) -> tuple[Verified, list[bool]]:
    """Model drafters' rows verified with their drafts' probabilities (``drafting.verify_row``),
    and per row whether the block reached past its last verified draft (a bonus token may follow);
    a row that leaves drafts of its round for later keeps its accepted drafts alone."""
    tokens, num_new, accepted = verified.tokens.clone(), verified.num_new.clone(), verified.accepted.clone()
    bonus = [True] * len(drafted)
    counters = counter.tolist()
    for line, ((_, chunk, verify), s) in enumerate(zip(drafted, settings)):
        rounds = s.speculation.rounds
        if rounds is None:
            continue
        one = D.verify_row(rounds, scores[line:line + 1], len(verify), s.key if s.do_sample else None,
                           counters[line])
        tokens[line, :len(verify) + 1] = one.tokens[0]
        num_new[line], accepted[line] = one.num_new[0], one.accepted[0]
        bonus[line] = chunk.num_drafts == len(rounds.drafts)
        if not bonus[line] and int(one.accepted[0]) == len(verify):
            num_new[line] = len(verify)
    return Verified(tokens=tokens, num_new=num_new, accepted=accepted), bonus


def verify_drafts(requests: Mapping[Hashable, RequestState], batch: S.ScheduledBatch, logits: torch.Tensor, *,
                  num_rows: int, max_len: int) -> dict[Hashable, tuple[list[int], list[float], list, bool]]:
    """The new tokens of every drafted chunk of ``batch`` from the forward's ``logits [R + E, V]``
    (``num_rows``: ``R``; ``max_len``: the processors' history width): per request
    ``(tokens, logprobs, top_logprobs, nonfinite)``, one logprob (and one list of top pairs, when
    the request asked) per token; ``nonfinite``: the raw logits were NaN/inf at a kept position."""
    drafted, offsets, extra = [], [], num_rows
    for row, chunk in enumerate(batch.chunks):
        offsets.append(extra)
        extra += chunk.num_drafts
        verify = _to_verify(requests[chunk.request_id], chunk)
        if verify is not None:
            drafted.append((row, chunk, verify))
    if not drafted:
        return {}
    device = logits.device
    width = max(len(verify) for _, _, verify in drafted)
    # Position i of a row's block: the logits after its last token and drafts[:i] (fed drafts only;
    # the row's own logits, after its last fed draft, stand in past them and are never kept).
    index = [[offsets[row] + i for i in range(chunk.num_drafts)] + [row] * (width + 1 - chunk.num_drafts)
             for row, chunk, _ in drafted]
    block = logits.index_select(0, torch.tensor(index, device=device).reshape(-1))
    block = block.reshape(len(drafted), width + 1, -1)
    drafts = torch.tensor([list(v) + [0] * (width - len(v)) for _, _, v in drafted], dtype=torch.int64,
                          device=device).reshape(len(drafted), width)
    num_valid = torch.tensor([len(v) for _, _, v in drafted], dtype=torch.int64, device=device)
    rows = [requests[chunk.request_id] for _, chunk, _ in drafted]
    settings = [_settings(r) for r in rows]
    sub_batch = S.ScheduledBatch(chunks=tuple(chunk for _, chunk, _ in drafted))
    history = build_row_history(requests, sub_batch, max_len=max_len + width + 1, device=device)
    allowed = _grammar_masked(block, rows, settings, [v for _, _, v in drafted])
    scores = process_block(_merged_chain(settings, device), allowed, history.tokens, history.cur_len,
                           history.prompt_len, drafts)
    counter = history.cur_len - history.prompt_len
    verified = _verify(drafts, num_valid, scores, settings, counter)
    verified, bonus = _verify_model_rows(verified, scores, drafted, settings, counter)
    before_limit = verified.accepted.tolist()
    verified = _limit(verified, rows, device)
    flat = block.reshape(-1, block.shape[-1])
    logprobs = chosen_logprobs(flat, verified.tokens.reshape(-1)).reshape(verified.tokens.shape)
    wanted = max(s.top_logprobs for s in settings)
    tops = top_logprobs(raw_logprobs(flat), wanted) if wanted else None
    bad = nonfinite_rows(flat).reshape(verified.tokens.shape)
    tokens, num_new, logprobs, bad = (verified.tokens.tolist(), verified.num_new.tolist(), logprobs.tolist(),
                                      bad.tolist())
    if tops is not None:
        top_ids = tops[0].reshape(*verified.tokens.shape, -1).tolist()
        top_values = tops[1].reshape(*verified.tokens.shape, -1).tolist()
    out = {}
    for line, request in enumerate(rows):
        count = _stop_cut(request, tokens[line][:num_new[line]], device)
        top = []
        if settings[line].top_logprobs:
            top = [top_pairs(top_ids[line][i], top_values[line][i], settings[line].top_logprobs) for i in range(count)]
        nonfinite = settings[line].check_finite and any(bad[line][:count])
        out[request.request_id] = (tokens[line][:count], logprobs[line][:count], top, nonfinite)
        rounds = settings[line].speculation.rounds
        if rounds is not None:
            D.settle(rounds, len(drafted[line][2]), before_limit[line], count, bonus[line])
    return out


def rewind(state: S.SchedulerState, batch: S.ScheduledBatch, new_tokens: Mapping[Hashable, object]
           ) -> tuple[S.SchedulerState, S.ScheduledBatch]:
    """Cut each drafted chunk back to the tokens its request keeps (``new_tokens``), before
    ``apply_step``: the chunk ends after the kept drafts, the request's computed count too, and its
    blocks past them are released. Requests ended meanwhile (failed, cancelled) are left alone."""
    if not any(chunk.num_drafts for chunk in batch.chunks):
        return state, batch
    alloc, requests, chunks = state.allocator, dict(state.requests), []
    for chunk in batch.chunks:
        request = requests.get(chunk.request_id)
        if not chunk.num_drafts or request is None or chunk.request_id not in new_tokens:
            chunks.append(chunk)
            continue
        taken = new_tokens[chunk.request_id]
        taken = len(taken) if isinstance(taken, (tuple, list)) else 1
        # The kept drafts' keys/values are written; the last new token is the next step's input.
        computed = chunk.end - chunk.num_drafts + taken - 1
        alloc, computed = B.truncate(alloc, chunk.request_id, computed)
        keep = max(computed - chunk.start, 0)
        requests[chunk.request_id] = request.replace(num_computed=computed)
        chunks.append(dataclasses.replace(chunk, token_ids=chunk.token_ids[:keep], num_drafts=0))
    return (state.replace(allocator=alloc, requests=MappingProxyType(requests)),
            dataclasses.replace(batch, chunks=tuple(chunks)))
