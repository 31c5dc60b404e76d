"""What a logits processor may read: the token buffer and where each row of it stands."""

from __future__ import annotations

import torch

from genfn.state.base import pytree_dataclass

__all__ = ["LogitsContext"]


@pytree_dataclass
class LogitsContext:
    """The view of a decoding state that logits processors see.

    ``tokens`` is the static ``[B, N]`` buffer. Row ``b`` of transformers' ``input_ids`` is
    ``tokens[b, :cur_len[b]]``: for ``generate`` the left-padded prompt followed by the generated
    tokens (every row then has the same lengths); a request inserted into a running batch has its
    own lengths and starts at column 0. ``prompt_len[b]`` is ``cur_len[b]`` at row ``b``'s first
    decode step. Columns ``>= cur_len[b]`` are garbage and must be masked out, never sliced off:
    slicing by a tensor length would make shapes dynamic inside a compiled step.

    ``cur_len`` and ``prompt_len`` are ``[B]`` int64; a 0-d length (one value for every row) is
    accepted too and broadcast, see :meth:`row_cur_len`.
    """

    tokens: torch.Tensor  # [B, N] int64
    cur_len: torch.Tensor  # [B] int64: filled columns of each row
    prompt_len: torch.Tensor  # [B] int64: cur_len of each row at its first decode step

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def row_cur_len(self) -> torch.Tensor:
        """``[B]`` int64 ``cur_len`` (a 0-d length broadcast to every row)."""
        return self.cur_len.to(self.tokens.device).reshape(-1).expand(self.batch_size)

    def row_prompt_len(self) -> torch.Tensor:
        """``[B]`` int64 ``prompt_len`` (a 0-d length broadcast to every row)."""
        return self.prompt_len.to(self.tokens.device).reshape(-1).expand(self.batch_size)

    def filled_mask(self) -> torch.Tensor:
        """``[B, N]`` bool: which columns of ``tokens`` hold real ``input_ids`` entries."""
        n = self.tokens.shape[1]
        return torch.arange(n, device=self.tokens.device).unsqueeze(0) < self.row_cur_len().unsqueeze(1)

    def last_token(self) -> torch.Tensor:
        """``[B]`` the most recent token of each row (``input_ids[:, -1]``)."""
        idx = (self.row_cur_len() - 1).clamp(min=0).unsqueeze(1)
        return self.tokens.gather(1, idx).squeeze(1)
