"""Block drafting (``speculation_type="dflash"``): a drafter proposes all ``k`` tokens in one forward.

A block drafter conditions on the target's hidden state at the last cached position (the state
whose logits chose the row's newest token) and on that newest token, and returns logits for the
``k`` positions after it in a single call: ``head(params, hidden [B, 1, H], newest [B]) -> [B, k, V]``.
The speculative step asks the verifying forward for its final hidden states when a drafter
declares ``needs_target_hidden`` and keeps the one at each row's last kept input, so the next round
drafts from it with no extra target forward.

DFlash's drafter is a small block-diffusion transformer trained against a specific target that
reads several of the target's intermediate layers; none exists for SmolLM2, so genfn ships the
verification path and this interface, and tests it with a tiny random head.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from genfn.strategies.assisted.drafter import Draft, DraftInput
from genfn.strategies.assisted.verify import Verified, draft_keys
from genfn.strategies.request import GenerationRequest
from genfn.strategies.token_choice import pick_tokens

__all__ = ["BlockDrafter"]


@dataclasses.dataclass(frozen=True, eq=False)
class BlockDrafter:
    """``head(params, hidden, newest)`` drafts ``num_tokens`` tokens a round in one call (identity-compared)."""

    head: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]
    params: Any
    num_tokens: int

    def __post_init__(self):
        if not callable(self.head):
            raise TypeError(f"BlockDrafter.head must be callable, got {type(self.head).__name__}")
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"BlockDrafter.num_tokens must be a positive int, got {self.num_tokens!r}")

    @property
    def gives_logits(self) -> bool:
        return True

    @property
    def needs_target_hidden(self) -> bool:
        return True

    def prefill(self, model, request: GenerationRequest) -> None:
        return None

    def draft(self, model, state: None, view: DraftInput, cache) -> tuple[Draft, None, Any]:
        if view.target_hidden is None:
            raise ValueError("a block drafter needs the target's hidden states (DraftInput.target_hidden)")
        newest = view.tokens.gather(1, (view.cur_len - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        logits = self.head(self.params, view.target_hidden, newest).float()
        batch, k = logits.shape[0], self.num_tokens
        if tuple(logits.shape[:2]) != (batch, k):
            raise ValueError(f"BlockDrafter.head must return logits [{batch}, {k}, vocab], got {list(logits.shape)}")
        if view.keys is not None:
            counters = view.counter.unsqueeze(1) + torch.arange(k, device=logits.device)
            keys = draft_keys(view.keys).unsqueeze(1).expand(batch, k, 2).reshape(batch * k, 2)
            tokens = pick_tokens(logits.reshape(batch * k, -1), keys, counters.reshape(-1)).view(batch, k)
        else:
            tokens = pick_tokens(logits)
        return Draft(tokens=tokens, num_valid=view.budget, logits=logits), state, cache

    def commit(self, state: None, verified: Verified, view: DraftInput) -> None:
        return state
