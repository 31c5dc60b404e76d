"""Classifier-free guidance as part of the decoding state: the unconditional branch.

transformers' ``UnbatchedClassifierFreeGuidanceLogitsProcessor`` hides a second model call and
its cache inside a logits processor. Here the unconditional branch is an explicit pytree,
:class:`GuidanceState` (its own static KV cache and the position of its newest token), carried
in ``DecodeState.guidance`` and advanced by the same pure step as the conditional branch:

* ``init``: prefill the negative prompt (``negative_prompt_ids`` / its mask), or, when none is
  given, the last token of each prompt row (transformers' default unconditional prompt);
* every ``step``: feed the newest token of the (shared) token buffer to the unconditional cache,
  exactly as transformers appends ``input_ids[:, -1:]`` to its unconditional context.

The branch's token stream is therefore (negative prompt, then the generated tokens): its prompt
part lives in its cache, the generated part is the shared buffer's. Positions follow
transformers: the model is called without position ids, so they count cache slots (``0..Pn-1``
for the negative prompt, padding included, then one more per step); padded slots are masked.

The combination (:func:`genfn.processors.guidance.guidance_combine`) runs at the head of the
logits-processor chain, where transformers puts CFG.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from genfn.config.caches import COMPILABLE_CACHES
from genfn.state.base import pytree_dataclass

__all__ = ["GuidanceSpec", "GuidanceState", "make_guidance_spec", "guidance_init", "guidance_step"]



@dataclasses.dataclass(frozen=True)
class GuidanceSpec:
    """What ``generate`` resolved for CFG: the scale and the unconditional prompt (None: each
    prompt row's last token)."""

    scale: float
    input_ids: torch.Tensor | None = None  # [B, Pn]
    attention_mask: torch.Tensor | None = None  # [B, Pn]


@pytree_dataclass
class GuidanceState:
    """The unconditional branch: its KV cache and the position id of its newest token."""

    cache: Any
    positions: torch.Tensor  # [B] int64


def make_guidance_spec(scale, negative_prompt_ids, negative_prompt_attention_mask, batch_size: int,
                       expand: int, vocab_size: int) -> GuidanceSpec:
    """Validate the negative prompt and repeat it like the prompt rows (``expand`` copies each)."""
    ids, mask = negative_prompt_ids, negative_prompt_attention_mask
    if ids is None:
        if mask is not None:
            raise ValueError("negative_prompt_attention_mask was given without negative_prompt_ids")
        return GuidanceSpec(float(scale))
    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[1] == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"negative_prompt_ids must be a non-empty [batch, length] tensor of token ids, got "
                         f"shape {list(ids.shape)} and dtype {ids.dtype}")
    ids = ids.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"negative_prompt_ids holds token ids outside the vocabulary [0, {vocab_size})")
    mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask).to(torch.int64)
    if mask.shape != ids.shape:
        raise ValueError(f"negative_prompt_attention_mask shape {list(mask.shape)} must equal negative_prompt_ids "
                         f"shape {list(ids.shape)}")
    if bool((mask[:, -1] == 0).any()) or bool((mask.sum(-1) == 0).any()):
        raise ValueError("negative_prompt_attention_mask must be left padded, with at least one real token per row")
    rows = ids.shape[0]
    if rows == batch_size // expand and expand > 1:
        ids, mask = ids.repeat_interleave(expand, dim=0), mask.repeat_interleave(expand, dim=0)
    elif rows == 1 and batch_size > 1:
        ids, mask = ids.expand(batch_size, -1).clone(), mask.expand(batch_size, -1).clone()
    elif rows != batch_size:
        raise ValueError(f"negative_prompt_ids has {rows} rows but the prompt has {batch_size // expand}")
    return GuidanceSpec(float(scale), ids, mask)


def guidance_init(model, spec: GuidanceSpec, input_ids: torch.Tensor, num_new_tokens: int,
                  cache_implementation: str | None = None) -> tuple[GuidanceState, torch.Tensor]:
    """Prefill the unconditional prompt: ``(state, unconditional logits [B, V] of its last position)``.

    Its cache has room for the unconditional prompt plus ``num_new_tokens``. It is a plain
    full-precision cache, as transformers' unconditional branch gets (a ``DynamicCache``): static
    when the conditional branch's cache is static (the compiled path needs fixed shapes),
    dynamic otherwise."""
    ids = input_ids[:, -1:] if spec.input_ids is None else spec.input_ids.to(input_ids.device)
    mask = None if spec.attention_mask is None else spec.attention_mask.to(input_ids.device)
    batch, length = ids.shape
    implementation = "static" if cache_implementation in COMPILABLE_CACHES else "dynamic"
    cache = model.init_cache(batch, length + num_new_tokens, implementation)
    positions = torch.arange(length, device=ids.device).unsqueeze(0).expand(batch, length)
    logits, cache = model.apply(ids, positions, cache, mask, logits_to_keep=1)
    last = torch.full((batch,), length - 1, dtype=torch.int64, device=ids.device)
    return GuidanceState(cache=cache, positions=last), logits[:, -1]


def guidance_step(model, state: GuidanceState, newest: torch.Tensor) -> tuple[GuidanceState, torch.Tensor]:
    """Feed ``newest [B, 1]`` (the token the conditional branch just chose) to the unconditional
    branch: ``(state, unconditional logits [B, V])``. Pure; donates ``state``."""
    positions = state.positions + 1
    logits, cache = model.apply(newest, positions.unsqueeze(1), state.cache)
    return GuidanceState(cache=cache, positions=positions), logits[:, -1]
