"""Classifier-free guidance: the arithmetic only.

transformers' ``UnbatchedClassifierFreeGuidanceLogitsProcessor`` runs the model a second time
on a negative (or empty) prompt with its own cache, hidden inside the processor. In genfn that
second forward belongs to the strategy layer, which owns models and caches; it calls
:func:`guidance_combine` with both logits and puts the result at the head of the processor
chain (CFG is first in transformers' order). ``build_logits_processors`` reports the need for
it in ``ProcessorChain.requires`` instead of building it.

The two transformers classes exist for code written against transformers, and take its calling
convention ``processor(input_ids, scores)``: ``ClassifierFreeGuidanceLogitsProcessor`` on a batch
that stacks the conditional rows over the unconditional ones (``[2B, V] -> [B, V]``), and
``UnbatchedClassifierFreeGuidanceLogitsProcessor``, which runs ``model`` itself on the
unconditional prompt (eagerly, recomputing it whole each call: no cache of its own). Neither is
part of a genfn chain: ``generate(guidance_scale=...)`` runs guidance inside the step instead.
"""

from __future__ import annotations

import torch

__all__ = ["guidance_combine", "ClassifierFreeGuidanceLogitsProcessor",
           "UnbatchedClassifierFreeGuidanceLogitsProcessor"]


def guidance_combine(logits: torch.Tensor, unconditional_logits: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """``s * (log p_cond - log p_uncond) + log p_uncond`` over log-softmaxed logits.

    With ``guidance_scale == 1`` the result is just the conditional log-probabilities, as in
    transformers.
    """
    scores = torch.nn.functional.log_softmax(logits, dim=-1)
    if guidance_scale == 1:
        return scores
    uncond = torch.nn.functional.log_softmax(unconditional_logits, dim=-1)
    return guidance_scale * (scores - uncond) + uncond


def _check_scale(guidance_scale) -> float:
    if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)) or not guidance_scale > 1:
        raise ValueError(f"Require guidance scale >1 to use the classifier free guidance processor, got guidance scale "
                         f"{guidance_scale}.")
    return guidance_scale


class ClassifierFreeGuidanceLogitsProcessor:
    """transformers' batched classifier-free guidance: ``scores [2B, V]`` holds the conditional
    rows first, the unconditional ones after; returns ``[B, V]`` guided log-probabilities."""

    def __init__(self, guidance_scale: float):
        self.guidance_scale = _check_scale(guidance_scale)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != 2 * input_ids.shape[0]:
            raise ValueError(f"Logits should have twice the batch size of the input ids, the first half of batches "
                             f"corresponding to the conditional inputs, and the second half of batches corresponding "
                             f"to the unconditional inputs. Got batch size {scores.shape[0]} for the logits and "
                             f"{input_ids.shape[0]} for the input ids.")
        half = input_ids.shape[0]
        cond, uncond = scores[:half], scores[half:]
        return uncond + (cond - uncond) * self.guidance_scale


class UnbatchedClassifierFreeGuidanceLogitsProcessor:
    """transformers' unbatched classifier-free guidance: ``model`` (a genfn ``Model`` or any module
    whose ``model(input_ids, attention_mask)`` has ``.logits``) scores the unconditional prompt,
    ``unconditional_ids`` (default: each row's last prompt token), continued by the tokens
    generated since the first call; guidance is applied to the log-softmaxed scores."""

    def __init__(self, guidance_scale: float, model, unconditional_ids: torch.Tensor | None = None,
                 unconditional_attention_mask: torch.Tensor | None = None, use_cache: bool | None = True):
        self.guidance_scale = guidance_scale
        self.model = model
        self.unconditional_context = {"input_ids": unconditional_ids, "attention_mask": unconditional_attention_mask,
                                      "use_cache": use_cache, "cache": None, "first_pass": True}
        self._prompt_len: int | None = None

    def _unconditional_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        context = self.unconditional_context
        if context["first_pass"]:
            context["first_pass"] = False
            self._prompt_len = input_ids.shape[1]
            if context["input_ids"] is None:
                context["input_ids"] = input_ids[:, -1:]
            if context["attention_mask"] is None:
                context["attention_mask"] = torch.ones_like(context["input_ids"], dtype=torch.long)
        new = input_ids[:, self._prompt_len:]
        ids = torch.cat([context["input_ids"], new], dim=1)
        mask = torch.cat([context["attention_mask"], torch.ones_like(new, dtype=torch.long)], dim=1)
        with torch.no_grad():
            return self.model(ids, mask).logits[:, -1]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.guidance_scale == 1:
            return torch.nn.functional.log_softmax(scores, dim=-1)
        uncond = self._unconditional_logits(input_ids).to(scores.device, scores.dtype)
        return guidance_combine(scores, uncond, self.guidance_scale)
