"""Prompt lookup decoding: draft the tokens that followed an earlier occurrence of the row's last n-gram.

Every row matches its own n-grams inside the static ``[B, N]`` token buffer with no host sync, so
the proposal runs inside a compiled step: on the CPU as one native op that scans each row
(``genfn/kernels/lookup_ops.cpp``), elsewhere as tensor ops that compare all windows of every row
at once (the same tensors, in ~80 small ops an eager step would dispatch one by one). As
transformers' ``PromptLookupCandidateGenerator``, the largest n-gram size that occurs earlier wins,
the continuation never reaches past the row's filled tokens, and the draft stops before its first
EOS. Which occurrence of that n-gram is
used is ``occurrence``: ``"latest"`` (the most recent one, nearest to what is being written) or
``"earliest"`` (transformers' choice, the first from the left). The drafts only change speed:
verification makes the output identical to plain decoding either way.
"""

from __future__ import annotations

import torch

from genfn.kernels import portable_ops_available

__all__ = ["propose_prompt_lookup", "OCCURRENCES"]

OCCURRENCES = ("latest", "earliest")


def _check(tokens, cur_len, num_output_tokens, max_matching_ngram_size, occurrence, eos_token_ids):
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise TypeError("tokens must be an int64 tensor [batch, N]")
    if not isinstance(cur_len, torch.Tensor) or tuple(cur_len.shape) != (tokens.shape[0],):
        raise ValueError(f"cur_len must be a tensor of shape [{tokens.shape[0]}] (filled columns per row)")
    for name, value in (("num_output_tokens", num_output_tokens),
                        ("max_matching_ngram_size", max_matching_ngram_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if occurrence not in OCCURRENCES:
        raise ValueError(f"occurrence must be one of {OCCURRENCES}, got {occurrence!r}")
    if not isinstance(eos_token_ids, tuple) or not all(isinstance(t, int) for t in eos_token_ids):
        raise TypeError("eos_token_ids must be a tuple of ints")


def _row_vector(value, name: str, batch: int) -> torch.Tensor | None:
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != (batch,):
        raise ValueError(f"{name} must be None or a tensor of shape [{batch}]")
    return value.to(torch.int64)


def propose_prompt_lookup(tokens: torch.Tensor, cur_len: torch.Tensor, num_output_tokens: int,
                          max_matching_ngram_size: int = 2, *, occurrence: str = "latest",
                          eos_token_ids: tuple[int, ...] = (), max_length: torch.Tensor | None = None,
                          first_column: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft up to ``num_output_tokens`` tokens per row: ``(draft [B, k], num_valid [B])``.

    Row ``b`` reads ``tokens[b, first_column[b]:cur_len[b]]`` (``first_column`` skips a row's
    left padding, so a padded row proposes what it would alone; default 0). For n from
    ``max_matching_ngram_size`` down to 1 it looks for an earlier window equal to its last n
    tokens that is followed by at least one token; the first n with such a window gives the
    draft, the tokens after the chosen window. ``num_valid`` is 0 when nothing matches, and when
    ``max_length[b]`` leaves room for no more than the target's own token. ``draft[b, j]`` for
    ``j >= num_valid[b]`` is garbage (but always a token id from the buffer).
    """
    _check(tokens, cur_len, num_output_tokens, max_matching_ngram_size, occurrence, eos_token_ids)
    batch = tokens.shape[0]
    lengths = cur_len.to(torch.int64)
    first = _row_vector(first_column, "first_column", batch)
    max_length = _row_vector(max_length, "max_length", batch)
    if tokens.device.type == "cpu" and portable_ops_available():
        # One native scan a row: the same tensors as the tensor ops, which an eager step would
        # dispatch as ~80 small ops.
        return torch.ops.genfn_kernels.propose_prompt_lookup(tokens, lengths, first, max_length, list(eos_token_ids),
                                                             num_output_tokens, max_matching_ngram_size,
                                                             occurrence == "latest")
    return _propose_with_tensor_ops(tokens, lengths, num_output_tokens, max_matching_ngram_size, occurrence,
                                    eos_token_ids, max_length, first)


def _propose_with_tensor_ops(tokens, lengths, num_output_tokens, max_matching_ngram_size, occurrence, eos_token_ids,
                             max_length, first):
    """:func:`propose_prompt_lookup` as tensor ops: every window of every row compared at once."""
    batch, width = tokens.shape
    device = tokens.device
    start = torch.zeros(batch, dtype=torch.int64, device=device)  # first continuation column
    found = torch.zeros(batch, dtype=torch.bool, device=device)
    for n in range(min(max_matching_ngram_size, width - 1), 0, -1):
        offsets = torch.arange(n, device=device)
        ngram = tokens.gather(1, (lengths.unsqueeze(1) - n + offsets).clamp(min=0))
        windows = tokens.unfold(1, n, 1)  # [B, width - n + 1, n]: window j covers columns j..j+n-1
        column = torch.arange(windows.shape[1], device=device).unsqueeze(0)
        # j + n < cur_len: a token follows the window, which also excludes the last n-gram itself.
        match = (windows == ngram.unsqueeze(1)).all(dim=-1) & (column + n < lengths.unsqueeze(1))
        if first is not None:
            # The window and the row's last n-gram both lie in the row's real tokens.
            match &= (column >= first.unsqueeze(1)) & (lengths - n > first).unsqueeze(1)
        if occurrence == "latest":
            where = torch.where(match, column, -1).amax(dim=1)
        else:
            where = torch.where(match, column, width).amin(dim=1)
        hit = match.any(dim=1)
        start = torch.where(hit & ~found, where + n, start)
        found = found | hit

    steps = torch.arange(num_output_tokens, device=device).unsqueeze(0)
    draft = tokens.gather(1, (start.unsqueeze(1) + steps).clamp(max=width - 1))
    num_valid = torch.where(found, torch.clamp(lengths - start, max=num_output_tokens), 0)
    if eos_token_ids:
        # An accepted EOS followed by more accepted drafts would run past the end of the text.
        eos = torch.tensor(eos_token_ids, dtype=tokens.dtype, device=device)
        first_eos = torch.where(torch.isin(draft, eos), steps, num_output_tokens).amin(dim=1)
        num_valid = torch.minimum(num_valid, first_eos)
    if max_length is not None:
        num_valid = torch.where(max_length - lengths <= 1, 0, num_valid)
    return draft, num_valid
