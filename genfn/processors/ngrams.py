"""N-gram bans: never repeat an n-gram of the sequence, or of the encoder input.

Both compare the last ``n - 1`` tokens with every ``(n - 1)``-prefix of the windows of a source
(the buffer itself, or the encoder ids) and ban the tokens that completed a matching window. The
windows are ``unfold`` views of the whole static buffer; windows that reach past ``cur_len`` are
masked out, which reproduces transformers' dictionary lookup without a Python loop.
"""

from __future__ import annotations

import torch

from genfn.processors.base import ProcessorBase, filled_tokens, tail_tokens, token_set_mask
from genfn.processors.context import LogitsContext
from genfn.state.base import pytree_dataclass, static_field

__all__ = ["NoRepeatNGramLogitsProcessor", "EncoderNoRepeatNGramLogitsProcessor"]


def _check_size(value: int, name: str) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` has to be a strictly positive integer, but is {value}")


def _ban_completions(
    logits: torch.Tensor, windows: torch.Tensor, valid: torch.Tensor, prefix: torch.Tensor
) -> torch.Tensor:
    """Ban ``windows[..., -1]`` wherever ``windows[..., :-1] == prefix`` and the window is valid.

    ``windows`` is ``[B, W, n]``, ``valid`` broadcastable to ``[B, W]``, ``prefix`` ``[B, n - 1]``.
    """
    vocab = logits.shape[-1]
    matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1) & valid
    banned_ids = torch.where(matches, windows[..., -1].clamp(max=vocab), vocab)
    banned = token_set_mask(banned_ids, vocab)
    return logits.masked_fill(banned, -float("inf"))


@pytree_dataclass
class NoRepeatNGramLogitsProcessor(ProcessorBase):
    """Forbid any token that would repeat an n-gram already present in the sequence."""

    ngram_size: int = static_field()

    def __post_init__(self):
        _check_size(self.ngram_size, "ngram_size")

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        n = self.ngram_size
        width = ctx.tokens.shape[1]
        if width < n:  # static: the buffer can never hold an n-gram
            return logits
        tokens = filled_tokens(ctx, logits.shape[-1])
        windows = tokens.unfold(1, n, 1)  # [B, W, n]
        starts = torch.arange(windows.shape[1], device=tokens.device)
        valid = (starts + n <= ctx.cur_len).unsqueeze(0)
        prefix = tail_tokens(ctx, n - 1)
        banned = _ban_completions(logits, windows, valid, prefix)
        return torch.where(ctx.cur_len < n, logits, banned)


@pytree_dataclass
class EncoderNoRepeatNGramLogitsProcessor(ProcessorBase):
    """Forbid completing any n-gram that occurs in the encoder input (used to stop a summarizer
    from copying long spans).

    ``encoder_input_ids`` is a constant ``[B_enc, L]`` tensor (rows map to the beam-expanded batch
    as ``row // (B // B_enc)``), or ``None`` to use the prompt columns of the buffer, which is what
    transformers passes for a decoder-only model.
    """

    ngram_size: int = static_field()
    encoder_input_ids: torch.Tensor | None = None

    def __post_init__(self):
        _check_size(self.ngram_size, "encoder_ngram_size")
        enc = self.encoder_input_ids
        if enc is not None and enc.dim() == 1:
            object.__setattr__(self, "encoder_input_ids", enc.unsqueeze(0))

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        n = self.ngram_size
        batch = logits.shape[0]
        enc = self.encoder_input_ids
        if enc is None:
            if ctx.tokens.shape[1] < n:
                return logits
            source = torch.where(
                torch.arange(ctx.tokens.shape[1], device=ctx.tokens.device).unsqueeze(0) < ctx.prompt_len,
                ctx.tokens,
                torch.full_like(ctx.tokens, logits.shape[-1]),
            )
            windows = source.unfold(1, n, 1)
            starts = torch.arange(windows.shape[1], device=source.device)
            valid = (starts + n <= ctx.prompt_len).unsqueeze(0)
        else:
            if enc.shape[1] < n:
                return logits
            enc = enc.to(logits.device)
            windows = enc.unfold(1, n, 1)
            windows = windows.repeat_interleave(batch // enc.shape[0], dim=0)
            valid = torch.ones((1, 1), dtype=torch.bool, device=logits.device)
        prefix = tail_tokens(ctx, n - 1)
        banned = _ban_completions(logits, windows, valid, prefix)
        # transformers looks up a prefix of exactly n - 1 tokens: none exists before then.
        return torch.where(ctx.cur_len < n - 1, logits, banned)
