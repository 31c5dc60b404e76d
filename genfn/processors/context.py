"""What a logits processor may read: the token buffer and where generation stands."""

from __future__ import annotations

import torch

from genfn.state.base import pytree_dataclass

__all__ = ["LogitsContext"]


@pytree_dataclass
class LogitsContext:
    """The view of a decoding state that logits processors see.

    ``tokens`` is the static ``[B, N]`` buffer; columns ``< cur_len`` hold the left-padded prompt
    followed by the generated tokens, exactly transformers' ``input_ids`` (pad tokens included).
    Columns ``>= cur_len`` are garbage and must be masked out, never sliced off: slicing by a
    tensor length would make shapes dynamic inside a compiled step.
    """

    tokens: torch.Tensor  # [B, N] int64
    cur_len: torch.Tensor  # [] int64: filled columns (the same for every row: prompts are left padded)
    prompt_len: torch.Tensor  # [] int64: the padded prompt length (cur_len at the first decode step)

    def filled_mask(self) -> torch.Tensor:
        """``[1, N]`` bool: which columns of ``tokens`` hold real ``input_ids`` entries."""
        n = self.tokens.shape[1]
        return (torch.arange(n, device=self.tokens.device) < self.cur_len).unsqueeze(0)

    def last_token(self) -> torch.Tensor:
        """``[B]`` the most recent token of each row (``input_ids[:, -1]``)."""
        idx = (self.cur_len - 1).clamp(min=0).reshape(1, 1).expand(self.tokens.shape[0], 1)
        return self.tokens.gather(1, idx).squeeze(1)
