"""The speculative step: draft ``k`` tokens, verify them with one target forward, keep what agrees.

A :class:`SpeculativeState` is a decoding state whose rows advance by 0..k+1 tokens a step.
``step`` is pure and has static shapes (the block is always ``k`` wide; each row's budget, valid
draft count and kept count are ``[B]`` tensors), so the driver compiles it once:

1. the drafter proposes ``[B, k]`` tokens and how many are valid per row (a model-free drafter,
   and any drafter under a grammar, at the end of the previous step: ``SpeculativeState.pending``);
2. the target runs ``[last token, drafts]`` (``[B, k + 1]``) at per-row positions in ONE forward,
   writing per-row cache slots;
3. :func:`~genfn.strategies.assisted.verify.verify_greedy` (or ``verify_sampling``) decides each
   row's kept prefix; :func:`~genfn.strategies.assisted.verify.limit_new_tokens` cuts it at EOS
   and ``max_length``, exactly where plain decoding would stop;
4. the kept tokens are written after each row's ``cur_len`` and the cache is rewound to the kept
   length: a rejected draft is undone by moving a pointer.

Finished rows append nothing (their columns stay padding, which is what plain decoding appends to
them), so the trimmed output equals plain decoding's token for token.

A round whose pending block gives no row a draft runs ``step_without_drafts`` instead, the same
verification over the newest token alone (one position wide; the strategy's ``pick_step`` tells the
driver, between steps). So the driver compiles at most two steps, each once.

Invariants between steps: row ``b``'s cache holds columns ``< cur_len[b] - 1`` (the newest token is
fed by the next step) and ``positions[b]`` is the position id of the last cached token. The token
buffer is ``k + 1`` columns wider than the cache, so a block written after any ``cur_len`` stays
inside it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import torch

from genfn.outputs import GenerateDecoderOnlyOutput
from genfn.processors.numerics import nonfinite_rows
from genfn.processors.grammar import apply_token_bitmask
from genfn.state.base import pytree_dataclass, static_field
from genfn.stopping import eos_emitted
from genfn.strategies import sample
from genfn.strategies.assisted.drafter import Draft, DraftInput, check_rows_independent
from genfn.strategies.assisted.schedule import draft_budget, update_schedule
from genfn.strategies.assisted.stats import AcceptanceStats, init_stats, record
from genfn.strategies.assisted.verify import Verified, limit_new_tokens, process_block, verify_greedy, verify_sampling
from genfn.strategies.base import Strategy
from genfn.strategies.request import GenerationRequest, StepTrace

__all__ = ["row_budget", "SpeculativeOptions", "SpeculativeState", "ModelDrafter", "PlainDrafter", "as_model_drafter",
           "GenerateAssistedOutput", "init", "step", "step_without_drafts", "pick_step", "finish",
           "speculative_strategy"]


@runtime_checkable
class ModelDrafter(Protocol):
    """A proposer that may run a model and touch the target's cache (draft model, early exit).

    ``prefill(model, request)`` builds its state (a draft model prefills its own cache);
    ``draft(model, state, view, cache)`` returns ``(Draft, state, cache)``: the target's cache
    comes back unchanged in length (early exit writes the target's first layers ahead and
    rewinds them); ``commit(state, verified, view)`` takes in the verified outcome.
    """

    @property
    def num_tokens(self) -> int: ...

    @property
    def gives_logits(self) -> bool: ...

    def prefill(self, model, request: GenerationRequest) -> Any: ...

    def draft(self, model, state: Any, view: DraftInput, cache: Any) -> tuple[Draft, Any, Any]: ...

    def commit(self, state: Any, verified: Verified, view: DraftInput) -> Any: ...


@dataclasses.dataclass(frozen=True)
class PlainDrafter:
    """A model-free :class:`~genfn.strategies.assisted.drafter.Drafter` (prompt lookup) as a :class:`ModelDrafter`."""

    inner: Any

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens

    @property
    def gives_logits(self) -> bool:
        return self.inner.gives_logits

    def prefill(self, model, request: GenerationRequest):
        return self.inner.init_state(request.batch_size, request.input_ids.device)

    def draft(self, model, state, view: DraftInput, cache):
        draft, state = self.inner.propose(state, view)
        return draft, state, cache

    def commit(self, state, verified: Verified, view: DraftInput):
        return self.inner.commit(state, verified, view)


def as_model_drafter(drafter) -> ModelDrafter:
    """``drafter`` itself when it is a :class:`ModelDrafter`, else wrapped in :class:`PlainDrafter`."""
    if hasattr(drafter, "draft") and hasattr(drafter, "prefill"):
        return drafter
    if hasattr(drafter, "propose") and hasattr(drafter, "init_state"):
        return PlainDrafter(drafter)
    raise TypeError(f"a drafter needs propose/init_state/commit (genfn.strategies.assisted.Drafter) or "
                    f"prefill/draft/commit (ModelDrafter); got {type(drafter).__name__}")


@dataclasses.dataclass(frozen=True)
class SpeculativeOptions:
    """Static settings of a speculative decode (they key the compiled step)."""

    do_sample: bool
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    check_finite: bool = True


@pytree_dataclass
class SpeculativeState:
    """Decoding state of speculative decoding; every length is per row ``[B]``."""

    tokens: torch.Tensor  # [B, max_cache_len + k + 1] int64; tokens[b, :cur_len[b]] is row b's input_ids
    cur_len: torch.Tensor  # [B] int64
    prompt_len: torch.Tensor  # [B] int64
    max_length: torch.Tensor  # [B] int64
    first_column: torch.Tensor  # [B] int64: the row's left padding (position 0 is at this column)
    positions: torch.Tensor  # [B] int64: position id of the last cached token
    done: torch.Tensor  # [B] bool
    keys: torch.Tensor | None  # [B, 2] when sampling
    cache: Any  # the target's cache
    nonfinite: torch.Tensor  # [B] bool
    drafter_state: Any
    schedule: Any  # DraftSchedule or None (the drafter's budget is then its block width)
    stats: AcceptanceStats
    ensemble_weight: torch.Tensor | None  # [B] float32: assistant_ensemble_weight, or None
    # [B, 1, H] the target's final hidden state at the last cached position, for drafters that
    # declare needs_target_hidden (block drafters), else None.
    target_hidden: torch.Tensor | None
    options: SpeculativeOptions = static_field()
    drafter: Any = static_field()
    processors: Any = None
    # The drafts proposed at the end of the previous step (a Draft, num_valid within each row's
    # budget), for a model-free drafter (the host picks the next step by them: pick_step) and under
    # a grammar (the host checks them against each row's grammar between steps, clipping num_valid).
    # None for a model drafter without a grammar, which drafts at the start of its step.
    pending: Any = None
    # Structured outputs: the masks [B, k + 1, ceil(V / 32)] int32 of the block's k + 1 positions
    # along the pending drafts (genfn.structured.speculative); None without a response_format.
    grammar_mask: torch.Tensor | None = None


def _widen(tokens: torch.Tensor, extra: int, pad_token_id: int) -> torch.Tensor:
    room = torch.full((tokens.shape[0], extra), pad_token_id, dtype=tokens.dtype, device=tokens.device)
    return torch.cat([tokens, room], dim=1)


def init(model, request: GenerationRequest, *, drafter: ModelDrafter, schedule=None, ensemble_weight=None
         ) -> SpeculativeState:
    """Prefill the target and choose the first token exactly as plain decoding does, then prefill the drafter."""
    drafter = as_model_drafter(drafter)
    if request.stop_strings is not None or request.guidance is not None:
        raise ValueError("assisted generation does not support stop_strings or guidance_scale yet; drop them or "
                         "the assistant (prompt_lookup_num_tokens / assistant_model / assistant_early_exit)")
    if request.processors is not None and getattr(request.processors, "stateful", False):
        raise ValueError("assisted generation cannot run a stateful logits processor (SynthID watermarking)")
    if ensemble_weight is not None and not drafter.gives_logits:
        raise ValueError(f"assistant_ensemble_weight needs the drafter's probabilities, and "
                         f"{type(getattr(drafter, 'inner', drafter)).__name__} gives none (prompt lookup has no "
                         "draft model); drop assistant_ensemble_weight or use an assistant_model")
    check_rows_independent(model, request.batch_size, "the model")
    wants_hidden = _needs_target_hidden(drafter)
    plain = sample.init(model, dataclasses.replace(request, output_hidden_states=True) if wants_hidden else request)
    batch = plain.batch_size
    device = plain.tokens.device
    options = SpeculativeOptions(do_sample=plain.options.do_sample, pad_token_id=plain.options.pad_token_id,
                                 eos_token_ids=plain.options.eos_token_ids, check_finite=plain.options.check_finite)
    weight = None
    if ensemble_weight is not None:
        weight = torch.full((batch,), float(ensemble_weight), dtype=torch.float32, device=device)
    state = SpeculativeState(
        tokens=_widen(plain.tokens, drafter.num_tokens + 1, options.pad_token_id),
        cur_len=plain.cur_len,
        prompt_len=plain.prompt_len,
        max_length=plain.max_length,
        first_column=(request.attention_mask == 0).sum(dim=1).to(torch.int64),
        positions=plain.positions,
        done=plain.done,
        keys=plain.keys,
        cache=plain.cache,
        nonfinite=plain.nonfinite,
        drafter_state=drafter.prefill(model, request),
        schedule=schedule,
        stats=init_stats(batch, device),
        ensemble_weight=weight,
        target_hidden=plain.prefill_hidden_states[-1][:, -1:].contiguous() if wants_hidden else None,
        options=options,
        drafter=drafter,
        processors=plain.processors,
    )
    if request.grammar is None and not isinstance(drafter, PlainDrafter):
        return state
    # Under a grammar, and for a model-free drafter, the drafts are proposed at the end of a step:
    # the host checks them against the matchers (and fills the block's masks), and sees the rows
    # without a draft (``pick_step``), before the next step verifies them.
    _, draft, drafter_state, cache = _propose(model, state)
    state = state.replace(pending=draft, drafter_state=drafter_state, cache=cache)
    if request.grammar is None:
        return state
    width = plain.grammar_mask.shape[-1]
    masks = torch.full((batch, drafter.num_tokens + 1, width), -1, dtype=torch.int32, device=device)
    return state.replace(grammar_mask=masks)


def _needs_target_hidden(drafter) -> bool:
    return bool(getattr(drafter, "needs_target_hidden", False))


def row_budget(state: SpeculativeState, k: int) -> torch.Tensor:
    """``[B]`` drafts each row may bring: its schedule, but never past ``max_length``; none once done."""
    if state.schedule is not None:
        budget = draft_budget(state.schedule, state.cur_len, state.max_length).clamp(max=k)
    else:
        budget = (state.max_length - state.cur_len - 1).clamp(min=0, max=k)
    return torch.where(state.done, 0, budget)


def _draft_input(state: SpeculativeState) -> DraftInput:
    counter = state.cur_len - state.prompt_len  # tokens each row generated so far (the noise counter)
    return DraftInput(tokens=state.tokens, cur_len=state.cur_len, budget=row_budget(state, state.drafter.num_tokens),
                      keys=state.keys, counter=counter, first_column=state.first_column,
                      target_hidden=state.target_hidden)


def _propose(model, state: SpeculativeState):
    """``(view, draft, drafter_state, cache)``: the drafter's block for ``state``, each row's
    ``num_valid`` within its budget (so the host reads a pending block's real draft counts)."""
    view = _draft_input(state)
    draft, drafter_state, cache = state.drafter.draft(model, state.drafter_state, view, state.cache)
    draft = draft.replace(num_valid=torch.minimum(draft.num_valid, view.budget))
    return view, draft, drafter_state, cache


def step(model, state: SpeculativeState) -> SpeculativeState:
    """One speculative round for every row (pure; donates ``state``)."""
    if state.pending is None:
        return _verify(model, state, *_propose(model, state))
    return _verify_pending(model, state, state.pending)


def step_without_drafts(model, state: SpeculativeState) -> SpeculativeState:
    """The round of a state whose pending block gives no row a draft: the target's one-token forward
    instead of ``k + 1`` positions of which ``k`` would be thrown away, then the next proposal.

    Its tokens, cache, statistics and random draws are ``step``'s on the same state (every draw is
    keyed by the row's counter, not by the block's width); only the forward is narrower.
    """
    pending = state.pending
    if pending is None:
        raise ValueError("step_without_drafts needs a pending block (a state whose drafts were proposed at the "
                         "end of the previous step: a model-free drafter or a grammar)")
    empty = Draft(tokens=pending.tokens[:, :0], num_valid=torch.zeros_like(pending.num_valid))
    return _verify_pending(model, state, empty)


def pick_step(state: SpeculativeState):
    """Between steps, on the host: ``step_without_drafts`` when no row of the pending block has a
    draft (prompt lookup found no earlier n-gram, or the rows are out of budget), else ``step``.

    One read of a ``[B]`` tensor a round; on the CPU that is no synchronization at all."""
    if state.pending is None or bool((state.pending.num_valid > 0).any()):
        return step
    return step_without_drafts


def _verify_pending(model, state: SpeculativeState, draft) -> SpeculativeState:
    """Verify the block proposed at the end of the previous step (checked by the host against the
    rows' grammars, if any), then propose the next one."""
    verified = _verify(model, state, _draft_input(state), draft, state.drafter_state, state.cache)
    _, draft, drafter_state, cache = _propose(model, verified)
    return verified.replace(pending=draft, drafter_state=drafter_state, cache=cache)


def _verify(model, state: SpeculativeState, view: DraftInput, draft, drafter_state, cache) -> SpeculativeState:
    """Verify ``draft`` (proposed for ``state`` as ``view``) with one target forward and keep what agrees."""
    opts, drafter = state.options, state.drafter
    k = draft.tokens.shape[1]  # the drafter's width, or 0 in step_without_drafts
    batch = state.tokens.shape[0]
    device = state.tokens.device
    counter = view.counter
    num_valid = draft.num_valid  # within each row's budget: _propose clipped it

    newest = sample.newest_input(state)  # [B, 1]
    block = torch.arange(k + 1, device=device)
    positions = (state.positions + 1).unsqueeze(1) + block
    cached = cache.length
    fed = torch.cat([newest, draft.tokens], dim=1)
    target_hidden = None
    if _needs_target_hidden(drafter):
        out = model.apply(fed, positions, cache, output_hidden_states=True)
        logits, cache, hidden = out.logits, out.cache, out.hidden_states[-1]
    else:
        logits, cache = model.apply(fed, positions, cache)
    # The grammar rules out tokens before the processors (the raw logits stay for the finiteness check).
    allowed = logits if state.grammar_mask is None else apply_token_bitmask(logits, state.grammar_mask[:, : k + 1])
    scores = process_block(state.processors, allowed, state.tokens, state.cur_len, state.prompt_len, draft.tokens)
    weight = state.ensemble_weight
    if opts.do_sample:
        verified = verify_sampling(draft.tokens, num_valid, scores, state.keys, counter, draft.logits, weight)
    else:
        verified = verify_greedy(draft.tokens, num_valid, scores, draft.logits, weight)
    verified = limit_new_tokens(verified, state.max_length - state.cur_len, opts.eos_token_ids)
    num_new = torch.where(state.done, 0, verified.num_new)
    accepted = torch.where(state.done, 0, verified.accepted)
    verified = Verified(tokens=verified.tokens, num_new=num_new, accepted=accepted)

    kept = block.unsqueeze(0) < num_new.unsqueeze(1)  # [B, k + 1]
    if _needs_target_hidden(drafter):
        # The last kept input's hidden state chose the row's new newest token.
        last_kept = (num_new - 1).clamp(min=0).reshape(batch, 1, 1).expand(batch, 1, hidden.shape[-1])
        target_hidden = torch.where(state.done.reshape(batch, 1, 1), state.target_hidden, hidden.gather(1, last_kept))
    nonfinite = state.nonfinite
    if opts.check_finite:
        nonfinite = nonfinite | (nonfinite_rows(logits) & kept).any(dim=1)
    # Columns after the kept tokens get padding: what plain decoding appends to a finished row.
    written = torch.where(kept, verified.tokens, opts.pad_token_id)
    state.tokens.scatter_(1, state.cur_len.unsqueeze(1) + block, written)
    cur_len = state.cur_len + num_new
    new_eos = (eos_emitted(verified.tokens, opts.eos_token_ids) & kept).any(dim=1)
    done = state.done | new_eos | (cur_len >= state.max_length)

    active = ~state.done
    schedule = state.schedule
    if schedule is not None:
        schedule = update_schedule(schedule, accepted, num_valid, active=active)
    return state.replace(
        cur_len=cur_len,
        positions=state.positions + num_new,
        done=done,
        cache=cache.rewind(cached + num_new),
        nonfinite=nonfinite,
        drafter_state=drafter.commit(drafter_state, verified, view),
        schedule=schedule,
        stats=record(state.stats, num_valid, accepted, active=active),
        target_hidden=target_hidden,
    )


@dataclasses.dataclass(eq=False)
class GenerateAssistedOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus the acceptance statistics of speculative decoding.

    ``acceptance``: per-row ``proposed`` / ``accepted`` / ``rounds`` (``[B]`` tensors) and the
    batch totals ``total_proposed``, ``total_accepted``, ``total_rounds``, ``acceptance_rate``
    (accepted / proposed) and ``tokens_per_round`` (tokens gained per target forward).
    """

    acceptance: dict | None = None


def finish(state: SpeculativeState, trace: StepTrace, request: GenerationRequest, on_finish=None):
    """Trim the buffer to the longest row; with ``return_dict_in_generate`` add the acceptance statistics."""
    if on_finish is not None:
        on_finish(state)
    sequences = state.tokens[:, : int(state.cur_len.max())].clone()
    if not request.config.return_dict_in_generate:
        return sequences
    stats = state.stats
    totals = stats.totals()
    acceptance = {"proposed": stats.proposed, "accepted": stats.accepted, "rounds": stats.rounds,
                  **{("total_" + name if name in ("proposed", "accepted", "rounds") else name): value
                     for name, value in totals.items()}}
    return GenerateAssistedOutput(sequences=sequences, cache=state.cache, acceptance=acceptance)


def speculative_strategy(drafter, *, schedule=None, ensemble_weight=None, on_finish=None,
                         name: str = "assisted") -> Strategy:
    """A :class:`~genfn.strategies.base.Strategy` drafting with ``drafter`` (``k + 1`` tokens a step at most).

    ``schedule``: a :class:`~genfn.strategies.assisted.schedule.DraftSchedule` for the draft
    budget (None: the block width); ``ensemble_weight``: ``assistant_ensemble_weight``;
    ``on_finish(state)`` sees the last state (the heuristic schedule carries across calls there).
    """
    drafter = as_model_drafter(drafter)
    k = drafter.num_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"the drafter's num_tokens must be a positive int, got {k!r}")
    return Strategy(
        name=name,
        init=lambda model, request: init(model, request, drafter=drafter, schedule=schedule,
                                         ensemble_weight=ensemble_weight),
        step=step,
        finish=lambda state, trace, request: finish(state, trace, request, on_finish),
        tokens_per_step=k + 1,
        # A model-free drafter (prompt lookup) often has nothing to propose; those rounds run the
        # one-token forward. A draft model always drafts while the budget lasts, and a drafter with
        # a distribution is verified against it (ensembles): both keep the one step.
        pick_step=pick_step if isinstance(drafter, PlainDrafter) and not drafter.gives_logits else None,
    )
