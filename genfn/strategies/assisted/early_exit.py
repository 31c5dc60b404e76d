"""Early-exit self-speculation (``assistant_early_exit=N``): draft with the target's first ``N`` layers.

The draft runs the target's first ``N`` layers, its final norm and its LM head (LayerSkip's
self-speculation), writing those layers' keys and values into the target's own cache ahead of its
fill pointer. The cache is rewound before verification, whose forward rewrites the same slots of
the same layers with identical values (same tokens, same positions, same weights) and fills the
deeper layers; no second cache is needed. Each round runs ``k`` shallow forwards (static shapes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from genfn.strategies.assisted.drafter import Draft, DraftInput
from genfn.strategies.assisted.verify import Verified, draft_keys
from genfn.strategies.request import GenerationRequest
from genfn.strategies.token_choice import pick_tokens

__all__ = ["EarlyExitDrafter"]


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter:
    """``num_layers`` (``assistant_early_exit``) shallow layers draft ``num_tokens`` tokens a round."""

    num_layers: int
    num_tokens: int

    def __post_init__(self):
        for name in ("num_layers", "num_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                label = "assistant_early_exit" if name == "num_layers" else "num_assistant_tokens"
                raise ValueError(f"{label} must be a positive int, got {value!r}")

    @property
    def gives_logits(self) -> bool:
        return True

    def prefill(self, model, request: GenerationRequest) -> None:
        if not getattr(model.spec, "layer_access", True):
            raise ValueError(f"assistant_early_exit needs the model's first layers as a function of their own, and "
                             f"{type(model.spec).__name__} runs its forward whole (a module wrapped with "
                             "genfn.from_module); use prompt_lookup_num_tokens or an assistant_model, or load the "
                             "checkpoint as a native genfn model (genfn.load)")
        total = getattr(model.spec, "num_layers", None)
        if total is not None and self.num_layers >= total:
            raise ValueError(f"assistant_early_exit={self.num_layers} must be below the model's {total} layers "
                             "(an exit at the last layer is the model itself)")
        return None

    def draft(self, model, state: None, view: DraftInput, cache) -> tuple[Draft, None, Any]:
        sampled = view.keys is not None
        keys = draft_keys(view.keys) if sampled else None
        cached = cache.length
        token = view.tokens.gather(1, (view.cur_len - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        position = view.cur_len - 1 - view.first_column
        tokens, all_logits = [], []
        for i in range(self.num_tokens):
            logits, cache = model.apply(token.unsqueeze(1), (position + i).unsqueeze(1), cache,
                                        num_layers=self.num_layers)
            logits = logits[:, -1]
            token = pick_tokens(logits, keys, view.counter + i)
            tokens.append(token)
            all_logits.append(logits)
        draft = Draft(tokens=torch.stack(tokens, dim=1), num_valid=view.budget, logits=torch.stack(all_logits, dim=1))
        return draft, state, cache.rewind(cached)

    def commit(self, state: None, verified: Verified, view: DraftInput) -> None:
        return state
