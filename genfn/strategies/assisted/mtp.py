"""Multi-token prediction (``use_mtp``): the target's own MTP heads draft, the main model verifies.

Head ``i`` reads the hidden state of depth ``i`` (the target's final hidden state at the last
cached position for head 0) and the token chosen at that depth, and predicts one token further
(:func:`genfn.models.llama.mtp_head`). The heads need no cache of their own; the block width is
the number of heads the model carries (``params["mtp"]``), and like every drafter's, the drafts
only change speed: verification keeps the output identical to plain decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from genfn.models.llama import mtp_head
from genfn.strategies.assisted.drafter import Draft, DraftInput
from genfn.strategies.assisted.verify import Verified, draft_keys
from genfn.strategies.request import GenerationRequest
from genfn.strategies.token_choice import pick_tokens

__all__ = ["MTPDrafter", "num_mtp_heads"]


def num_mtp_heads(model) -> int:
    """How many MTP heads ``model`` carries (0 when its params have none)."""
    params = getattr(model, "params", None)
    return len(params.get("mtp") or ()) if isinstance(params, dict) else 0


@dataclasses.dataclass(frozen=True)
class MTPDrafter:
    """Draft ``num_tokens`` tokens with the target's first ``num_tokens`` MTP heads."""

    num_tokens: int

    def __post_init__(self):
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"use_mtp needs at least one MTP head in the model, got num_tokens={self.num_tokens!r}")

    @property
    def gives_logits(self) -> bool:
        return True

    @property
    def needs_target_hidden(self) -> bool:
        return True

    def prefill(self, model, request: GenerationRequest) -> None:
        if num_mtp_heads(model) < self.num_tokens:
            raise ValueError(f"use_mtp: the model carries {num_mtp_heads(model)} MTP heads (params['mtp']), "
                             f"fewer than the {self.num_tokens} asked for")
        return None

    def draft(self, model, state: None, view: DraftInput, cache) -> tuple[Draft, None, Any]:
        token = view.tokens.gather(1, (view.cur_len - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        hidden = view.target_hidden[:, -1]
        keys = draft_keys(view.keys) if view.keys is not None else None
        tokens, all_logits = [], []
        for i in range(self.num_tokens):
            logits, hidden = mtp_head(model.spec, model.params, i, hidden, token)
            token = pick_tokens(logits, keys, view.counter + i)
            tokens.append(token)
            all_logits.append(logits)
        draft = Draft(tokens=torch.stack(tokens, dim=1), num_valid=view.budget, logits=torch.stack(all_logits, dim=1))
        return draft, state, cache

    def commit(self, state: None, verified: Verified, view: DraftInput) -> None:
        return state
