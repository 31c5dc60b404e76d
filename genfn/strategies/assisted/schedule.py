"""How many tokens the assistant drafts, and when its confidence stops a draft early.

Two small per-row state records with pure updates, matching transformers'
``AssistedCandidateGenerator``:

* :class:`DraftSchedule` is ``num_assistant_tokens`` under ``num_assistant_tokens_schedule``:
  ``"constant"`` never moves; ``"heuristic"`` adds 2 after a fully accepted draft and takes 1
  away otherwise (never below 1), and the value reached carries into the next call with the same
  assistant; ``"heuristic_transient"`` moves the same way within a call and starts every call
  afresh from the configured value.
* :class:`ConfidenceState` is ``assistant_confidence_threshold``: the assistant stops drafting
  right after a token whose probability is below the threshold, and the threshold adapts to the
  history of (draft-token probability, accepted?) pairs: once there are more than 5 of them with
  both outcomes, it becomes the ROC threshold that minimizes ``FPR + 3 FNR`` (transformers does
  this with scikit-learn's ``roc_curve``; here it is the same computation in torch, vectorized
  over rows, so it can run inside a compiled step).

Rows are independent: every number is a ``[B]`` tensor.
"""

from __future__ import annotations

import torch

from genfn.state.base import pytree_dataclass, static_field

__all__ = [
    "SCHEDULES", "DraftSchedule", "init_schedule", "update_schedule", "schedule_for_next_call", "draft_budget",
    "ConfidenceState", "init_confidence", "confident_length", "update_confidence", "roc_optimal_threshold",
]

SCHEDULES = ("constant", "heuristic", "heuristic_transient")


@pytree_dataclass
class DraftSchedule:
    """``num_tokens[b]`` is row ``b``'s current ``num_assistant_tokens``."""

    num_tokens: torch.Tensor  # [B] int64
    kind: str = static_field("constant")


def _check_kind(kind) -> None:
    if kind not in SCHEDULES:
        raise ValueError(f"num_assistant_tokens_schedule must be one of {SCHEDULES}, got {kind!r}")


def init_schedule(num_assistant_tokens, batch: int, kind: str = "constant", device=None) -> DraftSchedule:
    """A schedule for ``batch`` rows starting at ``num_assistant_tokens`` (an int, or a ``[B]`` tensor)."""
    _check_kind(kind)
    if isinstance(num_assistant_tokens, torch.Tensor):
        if tuple(num_assistant_tokens.shape) not in ((), (batch,)):
            raise ValueError(f"num_assistant_tokens must be an int or a [{batch}] tensor")
        num_tokens = num_assistant_tokens.to(torch.int64).expand(batch).clone()
    else:
        if isinstance(num_assistant_tokens, bool) or not isinstance(num_assistant_tokens, int) \
                or num_assistant_tokens < 1:
            raise ValueError(f"num_assistant_tokens must be a positive int, got {num_assistant_tokens!r}")
        num_tokens = torch.full((batch,), num_assistant_tokens, dtype=torch.int64, device=device)
    return DraftSchedule(num_tokens=num_tokens, kind=kind)


def update_schedule(schedule: DraftSchedule, accepted: torch.Tensor, proposed: torch.Tensor,
                    active: torch.Tensor | None = None) -> DraftSchedule:
    """After a verification: +2 where all ``proposed`` drafts were ``accepted``, else -1 (min 1).

    ``proposed`` is the number of drafts the row actually brought (it may be below
    ``num_tokens`` near ``max_length`` or after a confidence stop) and ``accepted`` the count
    after :func:`~genfn.strategies.assisted.verify.limit_new_tokens`, as transformers counts
    them. Rows where ``active`` is False (finished, or not drafting) keep their value.
    """
    if schedule.kind == "constant":
        return schedule
    n = schedule.num_tokens
    moved = torch.where(accepted == proposed, n + 2, (n - 1).clamp(min=1))
    if active is not None:
        moved = torch.where(active, moved, n)
    return schedule.replace(num_tokens=moved)


def schedule_for_next_call(schedule: DraftSchedule | None, num_assistant_tokens: int, batch: int,
                           kind: str, device=None) -> DraftSchedule:
    """The schedule a new call starts from, given the one the previous call with this assistant ended at.

    Only ``"heuristic"`` carries a value across calls. The assistant keeps one number, as
    transformers keeps one in the assistant's generation config: the rows' mean, rounded, which is
    the row's own value at batch size 1. This runs between calls, never inside a step.
    """
    _check_kind(kind)
    if kind != "heuristic" or schedule is None or schedule.kind != "heuristic":
        return init_schedule(num_assistant_tokens, batch, kind, device)
    carried = schedule.num_tokens.double().mean().round().to(torch.int64)
    return DraftSchedule(num_tokens=carried.expand(batch).clone().to(device or carried.device), kind=kind)


def draft_budget(schedule: DraftSchedule, cur_len: torch.Tensor, max_length: torch.Tensor) -> torch.Tensor:
    """``[B]`` drafts to ask for: ``num_tokens``, but never so many that the target's token passes ``max_length``."""
    return torch.minimum(schedule.num_tokens, max_length - cur_len - 1).clamp(min=0)


@pytree_dataclass
class ConfidenceState:
    """The confidence threshold per row and, when it adapts, the history it adapts to.

    ``probs[b, :count[b]]`` are the probabilities the assistant gave its drafted tokens and
    ``matches`` whether each was accepted, in order. Each verification appends at most as many
    entries as tokens the row gained, so a capacity of ``max_new_tokens`` reproduces transformers'
    unbounded lists exactly; entries past the capacity are dropped.
    """

    threshold: torch.Tensor  # [B] float64 (compared with probabilities exactly as transformers does)
    probs: torch.Tensor  # [B, H] float64
    matches: torch.Tensor  # [B, H] bool
    count: torch.Tensor  # [B] int64
    adaptive: bool = static_field(True)


def init_confidence(threshold: float, batch: int, capacity: int, adaptive: bool = True, device=None
                    ) -> ConfidenceState:
    """``threshold`` in [0, 1] (0 disables the early stop, as in transformers); ``capacity`` history entries."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise ValueError(f"assistant_confidence_threshold must be a float in [0, 1], got {threshold!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive int (use max_new_tokens), got {capacity!r}")
    return ConfidenceState(
        threshold=torch.full((batch,), float(threshold), dtype=torch.float64, device=device),
        probs=torch.zeros(batch, capacity, dtype=torch.float64, device=device),
        matches=torch.zeros(batch, capacity, dtype=torch.bool, device=device),
        count=torch.zeros(batch, dtype=torch.int64, device=device),
        # A zero threshold never stops a draft and transformers never adapts it.
        adaptive=bool(adaptive) and threshold > 0,
    )


def confident_length(draft_probs: torch.Tensor, threshold: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``[B]`` drafts kept: up to and including the first whose probability is below ``threshold``.

    ``draft_probs [B, k]`` are the assistant's probabilities of its own tokens; ``limit [B]``
    caps the count (the draft budget). The low-confidence token itself stays in the draft, as
    transformers' ``ConfidenceCriteria`` stops generation after emitting it.
    """
    k = draft_probs.shape[1]
    steps = torch.arange(k, device=draft_probs.device).unsqueeze(0)
    unsure = draft_probs.double() < threshold.unsqueeze(1)
    first_unsure = torch.where(unsure, steps, k).amin(dim=1)
    return torch.minimum((first_unsure + 1).clamp(max=k), limit.to(torch.int64))


def update_confidence(state: ConfidenceState, draft_probs: torch.Tensor, proposed: torch.Tensor,
                      accepted: torch.Tensor, active: torch.Tensor | None = None) -> ConfidenceState:
    """Record one verification and re-fit the threshold.

    The row keeps the probabilities of its ``accepted`` drafts as matches and, when it proposed
    more, that of the first rejected draft as a miss; later drafts were never judged and are
    forgotten. With more than 5 entries of both kinds the threshold becomes
    :func:`roc_optimal_threshold` of the history.
    """
    if not state.adaptive:
        return state
    batch, capacity = state.probs.shape
    k = draft_probs.shape[1]
    proposed, accepted = proposed.to(torch.int64), accepted.to(torch.int64)
    added = accepted + (proposed > accepted).long()
    if active is not None:
        added = torch.where(active, added, 0)
    steps = torch.arange(k, device=draft_probs.device).unsqueeze(0)
    target = state.count.unsqueeze(1) + steps
    # Entries past the row's additions or the capacity go to a spill column that is then cut off.
    target = torch.where((steps < added.unsqueeze(1)) & (target < capacity), target, capacity)
    spill_probs = torch.cat([state.probs, state.probs.new_zeros(batch, 1)], dim=1)
    spill_matches = torch.cat([state.matches, state.matches.new_zeros(batch, 1)], dim=1)
    probs = spill_probs.scatter(1, target, draft_probs.double())[:, :capacity]
    matches = spill_matches.scatter(1, target, steps < accepted.unsqueeze(1))[:, :capacity]
    count = (state.count + added).clamp(max=capacity)

    filled = torch.arange(capacity, device=probs.device).unsqueeze(0) < count.unsqueeze(1)
    hits = (matches & filled).sum(dim=1)
    ready = (count > 5) & (hits > 0) & (hits < count)
    threshold = torch.where(ready, roc_optimal_threshold(probs, matches, count), state.threshold)
    return state.replace(threshold=threshold, probs=probs, matches=matches, count=count)


def roc_optimal_threshold(probs: torch.Tensor, matches: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64: the ROC threshold minimizing ``FPR + 3 FNR`` over ``probs[b, :count[b]]``.

    The ROC points are those of scikit-learn's ``roc_curve`` with ``drop_intermediate=True``:
    one point per distinct score (scores descending), minus the points collinear with both
    neighbours in false- and true-positive counts, after an initial ``(0, 0)`` point at threshold
    ``+inf``. Ties in cost go to the first point, as ``numpy.argmin`` picks. Rows need both
    classes among their entries (the caller checks); other rows return garbage.
    """
    batch, capacity = probs.shape
    device = probs.device
    columns = torch.arange(capacity, device=device).unsqueeze(0)
    filled = columns < count.unsqueeze(1)
    # Probabilities are >= 0, so -1 sorts the unused entries after every real one.
    scores, order = torch.sort(torch.where(filled, probs, -1.0), dim=1, descending=True, stable=True)
    positive = (matches.gather(1, order) & filled).long()
    true_pos = positive.cumsum(dim=1)
    false_pos = columns + 1 - true_pos
    next_score = torch.cat([scores[:, 1:], scores.new_full((batch, 1), -1.0)], dim=1)
    # One ROC point per distinct score: the last sorted entry of each run of equal scores.
    is_point = filled & ((scores != next_score) | (columns == count.unsqueeze(1) - 1))
    num_points = is_point.sum(dim=1)
    slot = torch.where(is_point, is_point.long().cumsum(dim=1) - 1, capacity)

    def compact(values, fill):
        out = values.new_full((batch, capacity + 1), fill)
        return out.scatter(1, slot, values)[:, :capacity]

    fps, tps, thresholds = compact(false_pos, 0), compact(true_pos, 0), compact(scores, 0.0)
    point = columns < num_points.unsqueeze(1)

    def second_difference(values):
        before = torch.cat([values[:, :1], values[:, :-1]], dim=1)
        after = torch.cat([values[:, 1:], values[:, -1:]], dim=1)
        return before - 2 * values + after

    corner = (second_difference(fps) != 0) | (second_difference(tps) != 0)
    ends = (columns == 0) | (columns == num_points.unsqueeze(1) - 1)
    # scikit-learn thins only curves of more than two points; ends are always kept.
    kept = point & (corner | ends | (num_points <= 2).unsqueeze(1))

    negatives = (count - true_pos.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1)).double()
    positives = true_pos.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1).double()
    fpr = fps.double() / negatives.unsqueeze(1)
    fnr = 1 - tps.double() / positives.unsqueeze(1)
    costs = torch.where(kept, fpr + 3 * fnr, torch.inf)
    # The leading (0, 0) point at +inf: FPR 0, FNR 1.
    costs = torch.cat([costs.new_full((batch, 1), 3.0), costs], dim=1)
    best = costs.argmin(dim=1)
    chosen = thresholds.gather(1, (best - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(best == 0, torch.inf, chosen)
