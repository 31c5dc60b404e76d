"""Model drafters inside continuous batching: a draft model (``assistant_model``) or the model's own
first layers (``assistant_early_exit``) propose a request's drafts, beside the batch.

Each sequence that drafts with a model keeps a :class:`DraftRounds` box (in its ``Speculation``):
``generate``'s own drafter (``genfn.strategies.assisted.build.drafter_for``: ``DraftModelDrafter``
or ``EarlyExitDrafter``), its state at batch size 1 (the draft model's static cache, its adaptive
confidence threshold; for early exit, a static cache of the model's first layers that this module
keeps filled with the request's tokens), its draft-length schedule (``num_assistant_tokens_schedule``,
carried across calls as ``generate`` carries it) and the round it is in.

A *round* is what one speculative step of ``generate`` does: the drafter proposes up to ``k``
drafts after the row's newest token (its budget: the schedule, ``max_new_tokens``; then the
request's grammar cuts them at the first token it refuses), the target verifies them, and the row
keeps the accepted drafts plus one token of the target's. In a batch the drafts of a round ride in
the row's chunk of the packed forward (``genfn.batching.speculation``), as many as the step's token
budget and free blocks allow: ``f`` drafts fed give logits at ``f + 1`` positions, which verify the
round's next ``min(n, f + 1)`` drafts. When all of them are accepted and drafts remain (or the
bonus position was not computed), the row keeps those drafts alone and the round goes on in the
next step, from the same counter: draft ``i`` of a round is verified with the noise of token
``start + i`` whichever step verifies it, so a round split over steps keeps exactly the tokens of
the unsplit round. A round ends at the first rejection (the target's token from the residual
distribution, or its argmax), with the bonus token after a fully accepted round, or when the
request ends; then the schedule and the drafter's confidence take in the round as ``generate``'s
step does (``update_schedule``, ``drafter.commit``).

The first token of a request is chosen plainly (its prefill step), as ``generate``'s ``init``
chooses it. The box lives on the host beside the batch, so preemption (which frees the request's
paged blocks) leaves it as it is: the recomputed request continues its round in the chunk that
ends its recompute. When the box finds the request's tokens out of step with its round, it drops
the round and rebuilds its state from the request's tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from genfn.batching.requests import RequestState
from genfn.strategies.assisted.build import carried_schedules
from genfn.strategies.assisted.drafter import DraftInput
from genfn.strategies.assisted.early_exit import EarlyExitDrafter
from genfn.strategies.assisted.schedule import update_schedule
from genfn.strategies.assisted.verify import Verified, verify_greedy, verify_sampling
from genfn.strategies.sample import prefill_positions

__all__ = ["DraftRounds", "grammar_cut", "round_drafts", "settle", "verify_row"]


@dataclasses.dataclass(eq=False)
class DraftRounds:
    """One sequence's model drafter and the round it is in (a mutable host-side box).

    ``request``: the request's ``GenerationRequest`` (its prompt and cache length, which the
    drafter's prefill reads); ``schedule``: its one-row ``DraftSchedule`` (None: constant ``k``);
    ``schedule_owner``: the value ``generate`` carries a ``"heuristic"`` schedule on;
    ``ensemble_weight``: ``assistant_ensemble_weight``. The round: ``drafts`` not yet verified and
    their draft ``logits [len(drafts), V]``, ``proposed`` drafts in all, ``accepted`` so far,
    ``view`` (the ``DraftInput`` it was proposed with), ``generated``: the request's generated
    count the round expects next.
    """

    drafter: Any
    request: Any
    schedule: Any = None
    schedule_owner: Any = None
    ensemble_weight: float | None = None
    state: Any = None
    built: bool = False
    cache: Any = None  # early exit: the first layers' static cache, holding ``cached`` tokens
    cached: int = 0
    active: bool = False
    drafts: tuple[int, ...] = ()
    logits: torch.Tensor | None = None
    proposed: int = 0
    accepted: int = 0
    view: Any = None
    generated: int = 0

    @property
    def num_tokens(self) -> int:
        return self.drafter.num_tokens

    def reset(self) -> None:
        """Forget the round and the drafter's state (rebuilt from the request's tokens)."""
        self.state, self.built, self.cache, self.cached = None, False, None, 0
        self.active, self.drafts, self.logits = False, (), None


def _build(model, rounds: DraftRounds, token_ids: tuple[int, ...]) -> None:
    """The drafter's state from the request's tokens but the newest (``generate`` prefills the
    drafter with the prompt, the first token being the newest when drafting starts)."""
    device = model.device
    prefix = torch.tensor([list(token_ids[:-1])], dtype=torch.int64, device=device)
    request = dataclasses.replace(rounds.request, input_ids=prefix, attention_mask=torch.ones_like(prefix))
    rounds.state = rounds.drafter.prefill(model, request)
    if isinstance(rounds.drafter, EarlyExitDrafter):
        rounds.cache = model.init_cache(1, rounds.request.max_cache_len, "static")
        rounds.cached = 0
    rounds.built = True


def _catch_up(model, rounds: DraftRounds, token_ids: tuple[int, ...]) -> None:
    """Early exit drafts over its cache of the first layers, which must hold every token but the
    newest (``generate``'s verifying forward fills the target's; here the first layers are fed the
    tokens kept since)."""
    if not isinstance(rounds.drafter, EarlyExitDrafter):
        return
    end = len(token_ids) - 1
    if rounds.cached > end:
        rounds.cache = rounds.cache.rewind(torch.tensor([end], dtype=torch.int64, device=model.device))
        rounds.cached = end
    if rounds.cached == end:
        return
    tokens = torch.tensor([list(token_ids[rounds.cached:end])], dtype=torch.int64, device=model.device)
    positions = prefill_positions(torch.ones_like(tokens)) + rounds.cached
    _, rounds.cache = model.apply(tokens, positions, rounds.cache, num_layers=rounds.drafter.num_layers,
                                  logits_to_keep=1)
    rounds.cached = end


def _begin(model, request: RequestState, settings, rounds: DraftRounds, room: int) -> None:
    """Propose a round for ``request`` (its drafts within ``room``, then its grammar's cut)."""
    if not rounds.built:
        _build(model, rounds, request.token_ids)
    _catch_up(model, rounds, request.token_ids)
    k, device = rounds.num_tokens, model.device
    budget = min(k, max(room, 0))
    if rounds.schedule is not None:
        budget = min(budget, int(rounds.schedule.num_tokens[0]))
    n, generated = request.num_tokens, len(request.generated_ids)
    tokens = torch.zeros(1, n + k + 1, dtype=torch.int64, device=device)
    tokens[0, :n] = torch.tensor(request.token_ids, dtype=torch.int64, device=device)
    keys = settings.key.reshape(1, 2).to(device) if settings.do_sample else None

    def one(value):
        return torch.tensor([value], dtype=torch.int64, device=device)

    view = DraftInput(tokens=tokens, cur_len=one(n), budget=one(budget), keys=keys, counter=one(generated),
                      first_column=one(0))
    draft, rounds.state, cache = rounds.drafter.draft(model, rounds.state, view, rounds.cache)
    if rounds.cache is not None:
        rounds.cache = cache  # early exit rewound it to the tokens it held
    valid = min(int(draft.num_valid[0]), budget)
    drafts = draft.tokens[0, :valid].tolist()
    if settings.grammar is not None and valid:
        valid = grammar_cut(settings.grammar, request, drafts)
    rounds.drafts, rounds.logits = tuple(drafts[:valid]), draft.logits[0, :valid]
    rounds.proposed, rounds.accepted, rounds.view = valid, 0, view
    rounds.active, rounds.generated = True, generated


def grammar_cut(grammar, request: RequestState, drafts: list[int]) -> int:
    """How many of ``drafts`` the request's grammar allows (``generate``'s cut under a grammar)."""
    grammar.sync(0, request.generated_ids)
    if grammar.finished[0]:
        return len(drafts)
    masks = torch.empty(len(drafts) + 1, grammar.width, dtype=torch.int32)
    return grammar.walk_drafts(0, drafts, masks)


def round_drafts(model, request: RequestState, settings, rounds: DraftRounds, room: int) -> tuple[int, ...] | None:
    """The drafts of the round ``request`` is in (a new round proposed when it is in none), or None
    when it does not draft this step (its first token is chosen plainly, as ``generate`` does).
    ``room``: the most drafts the request may still take (``max_new_tokens``, the cache)."""
    generated = len(request.generated_ids)
    if generated == 0:
        return None
    if rounds.active and rounds.generated != generated:
        rounds.reset()  # out of step with the request: rebuild from its tokens
    if not rounds.active:
        _begin(model, request, settings, rounds, room)
    return rounds.drafts


def verify_row(rounds: DraftRounds, scores: torch.Tensor, count: int, key, counter: int) -> Verified:
    """``generate``'s verification of the round's next ``count`` drafts on the target's processed
    ``scores [1, >= count + 1, V]`` (with the drafts' probabilities when sampling; ``key``: the
    row's key ``[2]``, None for greedy; ``counter``: the tokens the request generated)."""
    device = scores.device
    drafts = torch.tensor([list(rounds.drafts[:count])], dtype=torch.int64, device=device).reshape(1, count)
    num_valid = torch.tensor([count], dtype=torch.int64, device=device)
    scores = scores[:, :count + 1]
    q = rounds.logits[:count].unsqueeze(0).to(device) if count else None
    weight = rounds.ensemble_weight if count else None
    if key is None:
        return verify_greedy(drafts, num_valid, scores, q, weight)
    counters = torch.tensor([counter], dtype=torch.int64, device=device)
    return verify_sampling(drafts, num_valid, scores, key.reshape(1, 2).to(device), counters, q, weight)


def settle(rounds: DraftRounds, verified: int, accepted: int, kept: int, bonus: bool) -> None:
    """Record a step of the round: ``verified`` drafts checked, ``accepted`` of them kept before the
    first rejection, ``kept`` tokens appended in all (after EOS, ``max_new_tokens`` and stop-string
    cuts), ``bonus``: the step could append the target's token after an all-accepted block. The
    round goes on while every checked draft was kept and no target token was appended."""
    if accepted == verified and not bonus and kept == verified:
        rounds.drafts, rounds.logits = rounds.drafts[verified:], rounds.logits[verified:]
        rounds.accepted += verified
        rounds.generated += verified
        return
    # As generate's limit_new_tokens counts a cut block: the kept drafts, the last token being the target's.
    taken = min(accepted, kept if accepted == verified and not bonus else max(kept - 1, 0))
    total = rounds.accepted + taken
    device = rounds.view.budget.device
    outcome = Verified(tokens=torch.zeros(1, 1, dtype=torch.int64, device=device),
                       num_new=torch.tensor([total + 1], device=device),
                       accepted=torch.tensor([total], dtype=torch.int64, device=device))
    if rounds.schedule is not None:
        active = torch.ones(1, dtype=torch.bool, device=rounds.schedule.num_tokens.device)
        rounds.schedule = update_schedule(rounds.schedule, outcome.accepted.to(active.device),
                                          torch.tensor([rounds.proposed], device=active.device), active=active)
        carried_schedules[rounds.schedule_owner] = rounds.schedule
    rounds.state = rounds.drafter.commit(rounds.state, outcome, rounds.view)
    rounds.active, rounds.drafts, rounds.logits = False, (), None
    rounds.accepted, rounds.generated = 0, rounds.generated + kept
