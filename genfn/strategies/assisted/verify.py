"""Verifying a block of draft tokens with one forward of the target model.

Every function here is pure and compile-safe: static shapes, no host syncs, no Python branching
on tensor values. A row ``b`` brings ``draft[b, :num_valid[b]]`` (columns past ``num_valid`` are
garbage that the target was fed but that can never be accepted) and the target's processed
logits ``target_logits[b, i]`` for the position after draft tokens ``0..i-1``. The result says
how many drafts a row keeps and which ``num_new = accepted + 1`` tokens it appends: the kept
drafts and then the target's own token (the correction at the first rejection, or the bonus
token after a fully accepted block). Greedy verification therefore appends exactly what plain
greedy decoding would, and speculative sampling keeps the target's distribution exactly.

Randomness. Row ``b`` with key ``keys[b]`` has generated ``counter[b]`` tokens before this
step, so the token verified at block index ``i`` is the row's token number ``counter + i``, and
every draw for it depends on (row key, ``counter + i``) only, never on the batch:

* the target's own token at index ``i`` (correction, bonus, or the per-position sample when the
  drafter gave no logits) uses ``gumbel(keys, counter + i)``: the very noise plain sampling uses
  for that token, so a drafter without logits (prompt lookup) reproduces plain sampling token
  for token;
* the accept/reject coin uses ``uniform(accept_keys(keys), counter + i)``;
* a drafter that samples its tokens must draw them from ``draft_keys(keys)``, a stream
  independent of both: the correction at a rejected index must not share noise with the draft
  token it replaces, or the residual distribution would be biased.
"""

from __future__ import annotations

import torch

from genfn import random as grandom
from genfn.processors.context import LogitsContext
from genfn.state.base import pytree_dataclass
from genfn.strategies.token_choice import argmax

__all__ = ["Verified", "verify_greedy", "verify_sampling", "limit_new_tokens", "process_block", "draft_keys",
           "accept_keys"]

# Stream tags folded into a row key; arbitrary constants, fixed forever (changing one changes tokens).
_DRAFT_STREAM = 0x64726166
_ACCEPT_STREAM = 0x61636370


def draft_keys(keys: torch.Tensor) -> torch.Tensor:
    """The keys ``[B, 2]`` a sampling drafter must draw its draft tokens from."""
    return grandom.fold_in(keys, _DRAFT_STREAM)


def accept_keys(keys: torch.Tensor) -> torch.Tensor:
    """The keys ``[B, 2]`` of the accept/reject coins of speculative sampling."""
    return grandom.fold_in(keys, _ACCEPT_STREAM)


@pytree_dataclass
class Verified:
    """What verification decided for every row.

    ``tokens[b, :num_new[b]]`` is what row ``b`` appends; columns past ``num_new`` are garbage.
    ``accepted[b]`` counts the draft tokens kept (the acceptance statistic and the input of the
    draft-length schedule); ``num_new`` is ``accepted + 1`` unless :func:`limit_new_tokens` cut it.
    """

    tokens: torch.Tensor  # [B, k + 1] int64
    num_new: torch.Tensor  # [B] int64, 0..k+1
    accepted: torch.Tensor  # [B] int64, 0..k


def _check_block(draft, num_valid, target_logits, draft_logits=None) -> tuple[int, int, int]:
    if not isinstance(draft, torch.Tensor) or draft.dim() != 2 or draft.dtype != torch.int64:
        raise TypeError("draft must be an int64 tensor [batch, k]")
    batch, k = draft.shape
    if not isinstance(num_valid, torch.Tensor) or tuple(num_valid.shape) != (batch,):
        raise ValueError(f"num_valid must be a tensor of shape [{batch}] (valid drafts per row)")
    if (not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 3
            or tuple(target_logits.shape[:2]) != (batch, k + 1)):
        got = list(target_logits.shape) if isinstance(target_logits, torch.Tensor) else type(target_logits).__name__
        raise ValueError(f"target_logits must have shape [{batch}, {k + 1}, vocab] for a draft of shape "
                         f"[{batch}, {k}], got {got}")
    vocab = target_logits.shape[-1]
    if draft_logits is not None and (not isinstance(draft_logits, torch.Tensor)
                                     or tuple(draft_logits.shape) != (batch, k, vocab)):
        got = list(draft_logits.shape) if isinstance(draft_logits, torch.Tensor) else type(draft_logits).__name__
        raise ValueError(f"draft_logits must have shape [{batch}, {k}, {vocab}], got {got}")
    if draft_logits is not None and k == 0:
        raise ValueError("draft_logits were given for an empty draft (k = 0); pass None")
    return batch, k, vocab


def _ensemble_weights(ensemble_weight, batch: int, device) -> torch.Tensor | None:
    """Per-row weights ``[B, 1, 1]`` float32; a Python float is checked here, a tensor is the caller's."""
    if ensemble_weight is None:
        return None
    if isinstance(ensemble_weight, bool) or not isinstance(ensemble_weight, (float, int, torch.Tensor)):
        raise TypeError("ensemble_weight must be None, a float in (0, 1), or a [batch] tensor of them")
    if not isinstance(ensemble_weight, torch.Tensor):
        if not 0.0 < ensemble_weight < 1.0:
            raise ValueError(f"ensemble_weight must be in the open interval (0, 1), got {ensemble_weight}")
        ensemble_weight = torch.full((batch,), float(ensemble_weight), device=device)
    if tuple(ensemble_weight.shape) not in ((), (batch,)):
        raise ValueError(f"ensemble_weight must be a scalar or a [{batch}] tensor, got {list(ensemble_weight.shape)}")
    return ensemble_weight.to(torch.float32).expand(batch).reshape(batch, 1, 1)


def process_block(processors, target_logits: torch.Tensor, tokens: torch.Tensor, cur_len: torch.Tensor,
                  prompt_len: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """The target's logits ``[B, k + 1, V]`` through ``processors``, each position in its own context.

    Position ``i`` of row ``b`` is processed as plain decoding would process it had the row
    already appended ``draft[b, :i]``: the context's tokens hold the drafts after the row's
    ``cur_len`` filled columns and its ``cur_len`` is ``cur_len + i`` (the per-row
    :class:`~genfn.processors.context.LogitsContext`). ``tokens`` itself is not written; its
    width must leave room for ``k`` more columns after every row's ``cur_len``. The logits are
    processed in float32, as transformers does before verifying. Stateful chains (SynthID) are
    refused: their state would have to advance along the kept drafts only.
    """
    if processors is None:
        return target_logits.float()
    if getattr(processors, "stateful", False):
        raise TypeError("process_block cannot run a stateful processor chain (SynthID watermarking) "
                        "over a draft block")
    batch, k = draft.shape
    if tuple(target_logits.shape[:2]) != (batch, k + 1):
        raise ValueError(f"target_logits must have shape [{batch}, {k + 1}, vocab] for a draft of shape "
                         f"[{batch}, {k}], got {list(target_logits.shape)}")
    if tokens.shape[1] < k:
        raise ValueError(f"tokens has {tokens.shape[1]} columns, fewer than the block's {k} drafts")
    columns = (cur_len.unsqueeze(1) + torch.arange(k, device=draft.device)).clamp(max=tokens.shape[1] - 1)
    with_draft = tokens.scatter(1, columns, draft)
    processed = []
    for i in range(k + 1):
        ctx = LogitsContext(tokens=with_draft, cur_len=cur_len + i, prompt_len=prompt_len)
        processed.append(processors(target_logits[:, i].float(), ctx))
    return torch.stack(processed, dim=1)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` how many columns of ``mask [B, k]`` are True before the first False."""
    return mask.long().cumprod(dim=1).sum(dim=1)


def _valid_columns(num_valid: torch.Tensor, k: int) -> torch.Tensor:
    return torch.arange(k, device=num_valid.device).unsqueeze(0) < num_valid.unsqueeze(1)


def _block_noise(keys: torch.Tensor, counter: torch.Tensor, width: int, size: int, kind) -> torch.Tensor:
    """``[B, width, size]`` noise where index ``i`` of row ``b`` is drawn at counter ``counter[b] + i``."""
    batch = keys.shape[0]
    counters = counter.to(torch.int64).unsqueeze(1) + torch.arange(width, device=keys.device).unsqueeze(0)
    flat_keys = keys.unsqueeze(1).expand(batch, width, 2).reshape(batch * width, 2)
    return kind(flat_keys, counters.reshape(-1), size).reshape(batch, width, size)


def _finish(selected: torch.Tensor, draft: torch.Tensor, num_valid: torch.Tensor) -> Verified:
    """Accept the drafts that agree with the target's own choices ``selected [B, k + 1]``."""
    k = draft.shape[1]
    agree = (draft == selected[:, :k]) & _valid_columns(num_valid, k)
    accepted = _leading_true(agree)
    return Verified(tokens=selected, num_new=accepted + 1, accepted=accepted)


def verify_greedy(draft: torch.Tensor, num_valid: torch.Tensor, target_logits: torch.Tensor,
                  draft_logits: torch.Tensor | None = None, ensemble_weight=None) -> Verified:
    """Keep the drafts that equal the target's argmax, then append the target's argmax.

    The appended tokens are ``argmax(target_logits[:, :num_new])`` — what plain greedy decoding
    picks at each of those positions, ties broken the same way. With ``ensemble_weight`` ``w``
    (it needs ``draft_logits``), drafted positions compare against ``argmax(w p + (1 - w) q)``
    of the probabilities instead, and the bonus position keeps the target's argmax, as
    transformers does.
    """
    batch, k, _ = _check_block(draft, num_valid, target_logits, draft_logits)
    weight = _ensemble_weights(ensemble_weight, batch, draft.device)
    selected = argmax(target_logits)
    if weight is not None:
        if draft_logits is None:
            raise ValueError("ensemble_weight needs the drafter's logits (draft_logits); "
                             "prompt lookup gives none, so it cannot use assistant_ensemble_weight")
        p = target_logits[:, :k].float().softmax(dim=-1)
        q = draft_logits.float().softmax(dim=-1)
        mixed = argmax(weight * p + (1.0 - weight) * q)
        drafted = _valid_columns(num_valid, k)
        selected = torch.cat([torch.where(drafted, mixed, selected[:, :k]), selected[:, k:]], dim=1)
    return _finish(selected, draft, num_valid)


def verify_sampling(draft: torch.Tensor, num_valid: torch.Tensor, target_logits: torch.Tensor,
                    keys: torch.Tensor, counter: torch.Tensor, draft_logits: torch.Tensor | None = None,
                    ensemble_weight=None) -> Verified:
    """Sampling verification; the appended tokens are distributed as plain sampling's.

    With ``draft_logits`` (the drafter's processed logits ``q``, from which its tokens were
    sampled with :func:`draft_keys`) this is speculative sampling (Leviathan et al. 2023,
    Chen et al. 2023): draft ``i`` is kept with probability ``min(1, p_i / q_i)``; at the first
    rejection the row samples from ``norm(max(0, p - q))``, and after a fully kept block from
    ``p``. With ``ensemble_weight`` ``w`` the drafts are verified against ``v = w p + (1 - w) q``
    (DIVERSE's static ensemble), so drafted positions follow ``v``; the residual ``max(0, v - q)
    = w max(0, p - q)`` normalizes to the same distribution, and the bonus still comes from ``p``.

    Without ``draft_logits`` (a deterministic drafter) every position samples from ``p`` with
    the plain-sampling noise and the drafts that equal those samples are kept: the row's tokens
    are then identical to plain sampling with the same key.
    """
    batch, k, vocab = _check_block(draft, num_valid, target_logits, draft_logits)
    weight = _ensemble_weights(ensemble_weight, batch, draft.device)
    if not isinstance(keys, torch.Tensor) or tuple(keys.shape) != (batch, 2) or keys.dtype != torch.int64:
        raise TypeError(f"keys must be per-row genfn keys: an int64 tensor [{batch}, 2] "
                        "(genfn.random.as_row_keys makes them)")
    if not isinstance(counter, torch.Tensor) or tuple(counter.shape) != (batch,):
        raise ValueError(f"counter must be a tensor of shape [{batch}]: tokens each row generated so far")
    if draft_logits is None:
        if weight is not None:
            raise ValueError("ensemble_weight needs the drafter's logits (draft_logits); "
                             "prompt lookup gives none, so it cannot use assistant_ensemble_weight")
        noise = _block_noise(keys, counter, k + 1, vocab, grandom.gumbel)
        return _finish(argmax(target_logits + noise), draft, num_valid)

    p = target_logits.float().softmax(dim=-1)
    q = draft_logits.float().softmax(dim=-1)
    p_draft = p[:, :k].gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    q_draft = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    verify_against = p_draft if weight is None else weight[:, :, 0] * p_draft + (1.0 - weight[:, :, 0]) * q_draft
    coins = _block_noise(accept_keys(keys), counter, k, 1, grandom.uniform).squeeze(-1)
    # u <= v / q without dividing: q may underflow to zero for a token the drafter barely allowed.
    kept = (coins * q_draft <= verify_against) & _valid_columns(num_valid, k)
    accepted = _leading_true(kept)

    at = accepted.reshape(batch, 1, 1).expand(batch, 1, vocab)
    p_at = p.gather(1, at).squeeze(1)
    logits_at = target_logits.gather(1, at).squeeze(1)
    rejected = accepted < num_valid  # else the block was used up: the bonus comes from p
    q_at = q.gather(1, at.clamp(max=k - 1)).squeeze(1) * rejected.unsqueeze(1)
    residual = (p_at - q_at).clamp(min=0.0)
    # p == q to rounding leaves no residual mass; that rejection had ~zero probability, and p is the
    # limit of the residual's alternatives, so it stands in instead of dividing by zero.
    empty = residual.sum(dim=-1, keepdim=True) <= torch.finfo(residual.dtype).tiny
    residual = torch.where(empty, p_at, residual)
    noise = grandom.gumbel(keys, counter.to(torch.int64) + accepted, vocab)
    # The bonus samples from the logits themselves, exactly as plain sampling does at that token.
    from_logits = argmax(logits_at.float() + noise)
    from_residual = argmax(residual.log() + noise)
    final = torch.where(rejected, from_residual, from_logits)
    tokens = torch.cat([draft, final.unsqueeze(1)], dim=1)
    tokens = tokens.scatter(1, accepted.unsqueeze(1), final.unsqueeze(1))
    return Verified(tokens=tokens, num_new=accepted + 1, accepted=accepted)


def limit_new_tokens(verified: Verified, budget: torch.Tensor | None = None,
                     eos_token_ids: tuple[int, ...] = ()) -> Verified:
    """Cut each row's appended tokens after its first EOS and to at most ``budget[b]`` tokens.

    A fully kept block may run past the row's ``max_length`` or keep tokens after an EOS, which
    plain decoding would never produce. As in transformers, ``accepted`` then drops to
    ``num_new - 1`` (and to 0 for a row with no budget left), so the draft-length schedule sees
    the cut.
    """
    if not isinstance(eos_token_ids, tuple) or not all(isinstance(t, int) for t in eos_token_ids):
        raise TypeError("eos_token_ids must be a tuple of ints")
    tokens, num_new = verified.tokens, verified.num_new
    width = tokens.shape[1]
    if eos_token_ids:
        eos = torch.tensor(eos_token_ids, dtype=tokens.dtype, device=tokens.device)
        columns = torch.arange(width, device=tokens.device).unsqueeze(0)
        is_eos = torch.isin(tokens, eos) & (columns < num_new.unsqueeze(1))
        first_eos = torch.where(is_eos, columns, width).amin(dim=1)
        num_new = torch.minimum(num_new, first_eos + 1)
    if budget is not None:
        if not isinstance(budget, torch.Tensor) or tuple(budget.shape) != tuple(num_new.shape):
            raise ValueError(f"budget must be a tensor of shape {list(num_new.shape)} (tokens each row may add)")
        num_new = torch.minimum(num_new, budget.to(num_new.dtype).clamp(min=0))
    accepted = torch.minimum(verified.accepted, (num_new - 1).clamp(min=0))
    return Verified(tokens=tokens, num_new=num_new, accepted=accepted)
