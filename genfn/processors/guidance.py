"""Classifier-free guidance: the arithmetic only.

transformers' ``UnbatchedClassifierFreeGuidanceLogitsProcessor`` runs the model a second time
on a negative (or empty) prompt with its own cache, hidden inside the processor. In genfn that
second forward belongs to the strategy layer, which owns models and caches; it calls
:func:`guidance_combine` with both logits and puts the result at the head of the processor
chain (CFG is first in transformers' order). ``build_logits_processors`` reports the need for
it in ``ProcessorChain.requires`` instead of building it.
"""

from __future__ import annotations

import torch

__all__ = ["guidance_combine"]


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
