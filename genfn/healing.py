"""Token healing: regenerate the last prompt token, constrained to extensions of it.

A prompt that ends mid-word (``'The link is <a href="http:'``) ends on a token the model rarely
sees at that spot: in training text, ``:`` followed by ``//`` is usually tokenized as one token
``://``. Healing drops the tail token and lets the model pick it again among the vocabulary
entries that *start with* it, favoured by a sequence bias (+10 each, +11 for the original, so
it is not healed too eagerly: ``http`` -> ``https`` only when the model insists).

This is transformers' ``GenerationMixin.heal_tokens``, as imperative preprocessing before the
pure decoding loop starts. Per row: decode the prompt (special tokens skipped), strip it,
re-tokenize, replace BOS by the pad id, and run one greedy step of ``generate`` with that bias.

Differences from transformers, all about its batch and tokenizer handling:

* the prefix search uses the tail token's own vocabulary spelling. transformers re-spells the
  decoded tail, mapping a space to the first character of ``convert_ids_to_tokens(
  convert_tokens_to_ids(" "))``, which on byte-level vocabularies (no ``" "`` entry) is the first
  character of the unknown token (``"<"`` for SmolLM2), so tails that begin with a space are never
  healed there. genfn heals them (``" http"`` -> ``" https"`` ...). Tails without a leading space
  behave identically;
* rows are re-tokenized and healed one by one without padding, then left padded again, and the
  attention mask is rebuilt from the new rows (transformers pads on the tokenizer's side, heals
  padded rows without a mask, and keeps the pre-healing attention mask);
* a single-token prompt is regenerated from BOS (transformers does so only inside a padded batch).
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from genfn.inputs import check_tokenizer

__all__ = ["heal_tokens", "token_extensions"]

_HEAL_BIAS = 10.0
_KEEP_BONUS = 1.0


def _sorted_vocabulary(tokenizer: Any) -> tuple[list[str], list[int]]:
    items = sorted(tokenizer.get_vocab().items())
    return [t for t, _ in items], [i for _, i in items]


def token_extensions(tokenizer: Any, token_id: int, vocabulary: tuple[list[str], list[int]] | None = None) -> list[int]:
    """Ids of every vocabulary entry whose spelling starts with ``token_id``'s (itself included)."""
    tokens, ids = vocabulary if vocabulary is not None else _sorted_vocabulary(tokenizer)
    prefix = tokenizer.convert_ids_to_tokens(int(token_id))
    if prefix is None:
        return []
    start = bisect.bisect_left(tokens, prefix)
    out = []
    for k in range(start, len(tokens)):
        if not tokens[k].startswith(prefix):
            break
        out.append(ids[k])
    return out


def heal_tokens(model, input_ids: torch.Tensor, tokenizer: Any, attention_mask: torch.Tensor | None = None, *,
                generate) -> tuple[torch.Tensor, torch.Tensor]:
    """``(healed input_ids, attention_mask)``, left padded, for ``input_ids [B, P]`` (left padded,
    ``attention_mask`` marking the real tokens). ``generate`` is ``genfn.generate`` (passed in, so
    this preprocessing step does not import the entry point that calls it)."""
    if tokenizer is None:
        raise ValueError(" When generating with token healing, you must pass the model's tokenizer to the `tokenizer` "
                         "argument of `generate`.")
    from genfn.config import GenerationConfig

    check_tokenizer(tokenizer, "token_healing",
                    ("get_vocab", "convert_ids_to_tokens", "decode", "encode"))
    missing = [a for a in ("bos_token_id", "pad_token_id", "eos_token_id") if not hasattr(tokenizer, a)]
    if missing:
        raise TypeError(f"token_healing needs a tokenizer with {', '.join(missing)} attributes (None where unset); "
                        f"{type(tokenizer).__name__} has none")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    bos_id, pad_id = tokenizer.bos_token_id, tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    vocabulary = _sorted_vocabulary(tokenizer)
    rows = []
    for row, mask in zip(input_ids.tolist(), attention_mask.tolist()):
        real = [t for t, m in zip(row, mask) if m]
        text = tokenizer.decode(real, skip_special_tokens=True).strip()
        ids = tokenizer.encode(text) if text else []
        ids = [pad_id if t == bos_id else t for t in ids]
        rows.append(_heal_row(model, ids, tokenizer, vocabulary, bos_id, pad_id, generate, GenerationConfig))
    width = max(1, max(len(r) for r in rows))
    healed = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            healed[i, width - len(r):] = torch.tensor(r, dtype=torch.int64)
            mask[i, width - len(r):] = 1
    if bool((mask.sum(-1) == 0).any()):
        raise ValueError("token healing left a prompt empty (it decodes to whitespace only)")
    return healed.to(input_ids.device), mask.to(input_ids.device)


def _heal_row(model, ids: list[int], tokenizer, vocabulary, bos_id, pad_id, generate, GenerationConfig) -> list[int]:
    if not ids or all(t == pad_id for t in ids):
        return ids
    tail = ids[-1]
    extensions = token_extensions(tokenizer, tail, vocabulary)
    if len(extensions) <= 1:
        return ids  # nothing to heal with
    bias = {(t,): _HEAL_BIAS for t in extensions}
    bias[(tail,)] = bias.get((tail,), 0.0) + _KEEP_BONUS
    trimmed = ids[:-1]
    if not trimmed:
        if bos_id is None:
            return ids
        trimmed = [bos_id]  # a single-token prompt is regenerated from BOS
    config = GenerationConfig(max_new_tokens=1, pad_token_id=pad_id, sequence_bias=bias, token_healing=False)
    device = model.device if hasattr(model, "device") else None
    out = generate(model, torch.tensor([trimmed], dtype=torch.int64, device=device), generation_config=config)
    return out[0].tolist()
