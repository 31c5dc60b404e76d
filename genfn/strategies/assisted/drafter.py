"""The interface every proposer implements, so one speculative step serves all of them.

A drafter is a static value (it keys compilation, like a processor kind) with a state pytree of
its own (a draft model's KV cache, nothing for prompt lookup). Each speculative step asks it for
a block of ``num_tokens`` drafts, verifies them with one target forward
(:mod:`genfn.strategies.assisted.verify`), then tells it what was kept so it can rewind its own
cache. Draft models, early exit (the first layers of the target), multi-token-prediction heads
and block drafters (DFlash) differ only in how ``propose`` fills the block:

* a draft model runs ``num_tokens`` decode steps of its own model and returns their logits;
* early exit runs the target's first layers and LM head, sharing the target's cache;
* MTP and DFlash read ``DraftInput.target_hidden`` (the target's hidden states at the last
  verified positions) and propose the whole block in one forward.

Only drafters that give ``logits`` can be verified by speculative sampling with the
accept/reject rule or with ``assistant_ensemble_weight``; a drafter without them (prompt lookup)
is verified by matching, which is exact for greedy and for sampling alike.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import dataclasses

import torch

from genfn.state.base import pytree_dataclass
from genfn.strategies.assisted.prompt_lookup import OCCURRENCES, propose_prompt_lookup
from genfn.strategies.assisted.verify import Verified

__all__ = ["Draft", "DraftInput", "Drafter", "PromptLookupDrafter", "check_ensemble_weight", "check_rows_independent"]


@pytree_dataclass
class Draft:
    """A block of drafts: ``tokens[b, :num_valid[b]]`` are real, the rest garbage token ids.

    ``logits`` are the drafter's processed logits ``[B, k, V]`` (the distribution each draft was
    sampled from, with ``verify.draft_keys``), or None for a drafter without a distribution.
    Unpacks as ``tokens, num_valid, logits``.
    """

    tokens: torch.Tensor  # [B, k] int64
    num_valid: torch.Tensor  # [B] int64
    logits: torch.Tensor | None = None  # [B, k, V] float

    def __iter__(self):
        return iter((self.tokens, self.num_valid, self.logits))


@pytree_dataclass
class DraftInput:
    """What a drafter may read about the target's decoding state (every field per row)."""

    tokens: torch.Tensor  # [B, N] int64: tokens[b, :cur_len[b]] is row b's input_ids
    cur_len: torch.Tensor  # [B] int64
    budget: torch.Tensor  # [B] int64: drafts the row may use (schedule and max_length)
    keys: torch.Tensor | None = None  # [B, 2] row keys when sampling
    counter: torch.Tensor | None = None  # [B] tokens each row generated so far
    first_column: torch.Tensor | None = None  # [B] the row's left padding
    target_hidden: torch.Tensor | None = None  # [B, T, H] the target's last hidden states (MTP, DFlash)


@runtime_checkable
class Drafter(Protocol):
    """A proposer of draft blocks; implementations are frozen, hashable values."""

    @property
    def num_tokens(self) -> int:
        """The static block width ``k``."""

    @property
    def gives_logits(self) -> bool:
        """Whether :attr:`Draft.logits` is filled (speculative sampling and ensembles need it)."""

    def init_state(self, batch: int, device: torch.device) -> Any:
        """The drafter's own state pytree (None when it has none)."""

    def propose(self, state: Any, view: DraftInput) -> tuple[Draft, Any]:
        """Draft a block for every row; pure, compile-safe."""

    def commit(self, state: Any, verified: Verified, view: DraftInput) -> Any:
        """Take in the verified outcome (rewind the drafter's cache to the kept tokens); pure."""


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter:
    """Prompt lookup decoding as a :class:`Drafter`: ``prompt_lookup_num_tokens`` drafts a step."""

    num_tokens: int
    max_matching_ngram_size: int = 2
    occurrence: str = "latest"
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("num_tokens", "max_matching_ngram_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.occurrence not in OCCURRENCES:
            raise ValueError(f"occurrence must be one of {OCCURRENCES}, got {self.occurrence!r}")

    @property
    def gives_logits(self) -> bool:
        return False

    def init_state(self, batch: int, device: torch.device) -> None:
        return None

    def propose(self, state: None, view: DraftInput) -> tuple[Draft, None]:
        tokens, num_valid = propose_prompt_lookup(
            view.tokens, view.cur_len, self.num_tokens, self.max_matching_ngram_size,
            occurrence=self.occurrence, eos_token_ids=self.eos_token_ids, first_column=view.first_column)
        return Draft(tokens=tokens, num_valid=torch.minimum(num_valid, view.budget.clamp(min=0))), state

    def commit(self, state: None, verified: Verified, view: DraftInput) -> None:
        return state


def check_ensemble_weight(drafter: Drafter, ensemble_weight) -> None:
    """Raise the error a user sees when ``assistant_ensemble_weight`` meets a drafter without logits."""
    if ensemble_weight is not None and not drafter.gives_logits:
        raise ValueError(f"assistant_ensemble_weight needs the drafter's probabilities, and "
                         f"{type(drafter).__name__} gives none (prompt lookup has no draft model); "
                         "drop assistant_ensemble_weight or use an assistant_model")


def check_rows_independent(model, batch_size: int, name: str) -> None:
    """Speculative rows keep different numbers of drafts, so their cache slots part; a model whose
    forward needs every row at the same slot (``spec.rows_independent`` False) runs at batch 1 only."""
    if batch_size > 1 and not getattr(model.spec, "rows_independent", True):
        raise ValueError(f"assisted generation at batch size {batch_size} needs {name} to take each row at its own "
                         f"cache slot, and {model.spec!r} takes one offset for the whole batch (its module does not "
                         "build masks with transformers' sdpa or eager attention); run one row at a time")
