"""A draft model (``assistant_model``) as a proposer: ``k`` cheap decode steps of another genfn model.

The assistant shares the target's vocabulary and keeps its own static KV cache, prefilled with the
prompt. Its cache follows the target's columns slot for slot, so keeping it in step with what
verification kept is a pointer move: each round first rewinds it to ``cur_len - 2`` and feeds the
two newest tokens (the older one is usually cached already and is rewritten with identical keys
and values; after a fully accepted block it is the one token the assistant never saw). Every
round runs all ``k`` assistant steps (static shapes); the budget and the confidence stop only
decide how many of the drafts are offered for verification.

Greedy drafts are the assistant's argmax; sampled drafts come from its softmax with
``verify.draft_keys``, and its logits go to speculative sampling as ``q``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from genfn.state.base import pytree_dataclass
from genfn.strategies.assisted.drafter import Draft, DraftInput, check_rows_independent
from genfn.strategies.assisted.schedule import ConfidenceState, confident_length, init_confidence, update_confidence
from genfn.strategies.assisted.verify import Verified, draft_keys
from genfn.strategies.request import GenerationRequest
from genfn.strategies.sample import prefill_positions
from genfn.strategies.token_choice import pick_tokens

__all__ = ["DraftModelDrafter", "DraftModelState"]


@pytree_dataclass
class DraftModelState:
    cache: Any  # the assistant's StaticCache
    confidence: ConfidenceState | None  # assistant_confidence_threshold, adapting (None: off)
    draft_probs: torch.Tensor  # [B, k] float32: the assistant's probability of each draft (last round)
    proposed: torch.Tensor  # [B] int64: drafts offered in the last round


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """Draft with ``assistant`` (a genfn ``Model``, compared by identity); equal settings with the same
    assistant compare equal, so every call reuses one compiled step.

    ``num_tokens``: the block width ``k`` (``num_assistant_tokens``); ``confidence_threshold``:
    ``assistant_confidence_threshold`` (0 disables the early stop); ``confidence_capacity``: how
    many (probability, accepted) pairs the adaptive threshold remembers per row.
    """

    assistant: Any
    num_tokens: int
    confidence_threshold: float = 0.0
    confidence_capacity: int = 256

    def __post_init__(self):
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"num_assistant_tokens must be a positive int, got {self.num_tokens!r}")
        for name in ("apply", "init_cache", "vocab_size"):
            if not hasattr(self.assistant, name):
                raise TypeError(f"assistant_model must be a genfn Model (load it with genfn.load), got "
                                f"{type(self.assistant).__name__}")

    @property
    def gives_logits(self) -> bool:
        return True

    def prefill(self, model, request: GenerationRequest) -> DraftModelState:
        if self.assistant.vocab_size != model.vocab_size:
            raise ValueError(f"assistant_model has a vocabulary of {self.assistant.vocab_size} tokens and the model "
                             f"{model.vocab_size}; an assistant must share the target's tokenizer")
        batch = request.batch_size
        device = request.input_ids.device
        check_rows_independent(self.assistant, batch, "assistant_model")
        cache = self.assistant.init_cache(batch, request.max_cache_len, "static")
        _, cache = self.assistant.apply(request.input_ids, prefill_positions(request.attention_mask), cache,
                                        request.attention_mask, logits_to_keep=1)
        confidence = None
        if self.confidence_threshold > 0:
            confidence = init_confidence(self.confidence_threshold, batch, self.confidence_capacity, device=device)
        return DraftModelState(cache=cache, confidence=confidence,
                               draft_probs=torch.zeros(batch, self.num_tokens, device=device),
                               proposed=torch.zeros(batch, dtype=torch.int64, device=device))

    def draft(self, model, state: DraftModelState, view: DraftInput, cache) -> tuple[Draft, DraftModelState, Any]:
        assistant = self.assistant.functional()
        k = self.num_tokens
        sampled = view.keys is not None
        own = state.cache.rewind((view.cur_len - 2).clamp(min=0))
        span = getattr(cache, "span", None)
        if span is not None and own.max_cache_len == cache.max_cache_len:
            own = own.replace(span=span)  # attend over the filled slots only, as the target does
        columns = (view.cur_len - 2).clamp(min=0).unsqueeze(1) + torch.arange(2, device=view.cur_len.device)
        positions = columns - view.first_column.unsqueeze(1)
        logits, own = assistant.apply(view.tokens.gather(1, columns), positions, own)
        logits = logits[:, -1]
        keys = draft_keys(view.keys) if sampled else None
        tokens, all_logits, probs = [], [], []
        for i in range(k):
            token = pick_tokens(logits, keys, view.counter + i)
            tokens.append(token)
            all_logits.append(logits)
            probs.append(logits.softmax(dim=-1).gather(1, token.unsqueeze(1)).squeeze(1))
            if i + 1 < k:
                logits, own = assistant.apply(token.unsqueeze(1), (positions[:, -1] + 1 + i).unsqueeze(1), own)
                logits = logits[:, -1]
        draft_probs = torch.stack(probs, dim=1)
        num_valid = view.budget
        if state.confidence is not None:
            num_valid = confident_length(draft_probs, state.confidence.threshold, view.budget)
        # The logits also serve greedy verification with assistant_ensemble_weight.
        draft = Draft(tokens=torch.stack(tokens, dim=1), num_valid=num_valid, logits=torch.stack(all_logits, dim=1))
        return draft, state.replace(cache=own.replace(span=None), draft_probs=draft_probs, proposed=num_valid), cache

    def commit(self, state: DraftModelState, verified: Verified, view: DraftInput) -> DraftModelState:
        if state.confidence is None:
            return state
        active = view.budget > 0
        confidence = update_confidence(state.confidence, state.draft_probs, state.proposed, verified.accepted,
                                       active=active)
        return state.replace(confidence=confidence)
