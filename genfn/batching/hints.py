"""``WorkloadHints``: what a user expects to run, turned into the paged cache's and scheduler's sizes.

Given expected prompt and generation lengths and how many requests run at once, ``resolve``
picks a block size, a block count (or, with a memory budget, what fits in it), the token budget
of a forward, the request cap of a batch, and the block-table width. Every pick can be
overridden by the caller; the rule behind each is in its comment.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["BatchingSizes", "WorkloadHints", "kv_bytes_per_block", "resolve"]


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1{' or None' if allow_none else ''}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class WorkloadHints:
    """Expected lengths (typical) and bounds (worst case, ``None``: twice the typical).

    ``concurrent_requests``: how many requests should decode side by side.
    """

    expected_prompt_len: int = 256
    expected_new_tokens: int = 256
    concurrent_requests: int = 32
    max_prompt_len: int | None = None
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("expected_prompt_len", "expected_new_tokens", "concurrent_requests"):
            _positive_int(name, getattr(self, name))
        for name in ("max_prompt_len", "max_new_tokens"):
            _positive_int(name, getattr(self, name), allow_none=True)
        if self.max_prompt_len is not None and self.max_prompt_len < self.expected_prompt_len:
            raise ValueError("`max_prompt_len` must be >= `expected_prompt_len`")
        if self.max_new_tokens is not None and self.max_new_tokens < self.expected_new_tokens:
            raise ValueError("`max_new_tokens` must be >= `expected_new_tokens`")

    @classmethod
    def for_context(cls, context: int | None) -> "WorkloadHints":
        """The default hints, except that any one request may use a ``context``-token window
        (the model's ``max_position_embeddings``): the defaults alone cap a request at 1024
        tokens, which would refuse most of SmolLM2's 8192. The typical sizes, and so the block
        count, stay the defaults'."""
        defaults = cls()
        if context is None or context <= defaults.longest_request:
            return defaults
        return cls(max_prompt_len=context - defaults.expected_new_tokens, max_new_tokens=defaults.expected_new_tokens)

    @property
    def longest_request(self) -> int:
        prompt = self.max_prompt_len or 2 * self.expected_prompt_len
        new = self.max_new_tokens or 2 * self.expected_new_tokens
        return prompt + new


@dataclasses.dataclass(frozen=True)
class BatchingSizes:
    block_size: int
    num_blocks: int
    max_batch_tokens: int
    max_requests_per_batch: int
    max_blocks_per_request: int


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype = torch.float32) -> int:
    """Bytes one block takes across all layers, keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * block_size * head_dim * itemsize


def resolve(hints: WorkloadHints | None = None, *, block_size: int | None = None, num_blocks: int | None = None,
            max_batch_tokens: int | None = None, max_requests_per_batch: int | None = None,
            memory_budget_bytes: int | None = None, num_layers: int | None = None, num_kv_heads: int | None = None,
            head_dim: int | None = None, dtype: torch.dtype = torch.float32,
            whole_prompts: bool = False) -> BatchingSizes:
    """Sizes for ``hints`` (defaults: ``WorkloadHints()``); arguments given win over the hints.

    ``memory_budget_bytes`` (with the model's ``num_layers``, ``num_kv_heads``, ``head_dim`` and
    the cache ``dtype``) caps the block count at what that memory holds. ``whole_prompts``: each
    prompt runs in one forward (chunked prefill off), so the token budget picked holds the hints'
    longest prompt (``max_prompt_len``).
    """
    hints = hints or WorkloadHints()
    for name, value in (("block_size", block_size), ("num_blocks", num_blocks),
                        ("max_batch_tokens", max_batch_tokens), ("max_requests_per_batch", max_requests_per_batch),
                        ("memory_budget_bytes", memory_budget_bytes)):
        _positive_int(name, value, allow_none=True)
    typical = hints.expected_prompt_len + hints.expected_new_tokens
    # Small blocks waste less of a request's last block and share prompts at a finer grain; long
    # sequences take larger ones so block tables (and the gather over them) stay short.
    if block_size is None:
        block_size = 16 if typical <= 2048 else 32 if typical <= 8192 else 64
    blocks_per_typical = -(-typical // block_size)
    table_width = -(-hints.longest_request // block_size)
    if num_blocks is None:
        # The concurrent requests at their typical length, a quarter more for the spread of
        # lengths, and room for one worst-case request, so it never fails for want of blocks.
        num_blocks = max(hints.concurrent_requests * blocks_per_typical * 5 // 4, table_width)
    if memory_budget_bytes is not None:
        missing = [n for n, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                                  ("head_dim", head_dim)) if v is None]
        if missing:
            raise ValueError(f"`memory_budget_bytes` needs the model's {', '.join(missing)}")
        # The paged cache holds one extra (sink) block.
        fits = memory_budget_bytes // kv_bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype) - 1
        if fits < 1:
            raise ValueError(f"`memory_budget_bytes` ({memory_budget_bytes}) holds no block of {block_size} tokens")
        num_blocks = min(num_blocks, fits)
    if max_requests_per_batch is None:
        max_requests_per_batch = hints.concurrent_requests
    if max_batch_tokens is None:
        # Every running request decodes, and a typical prompt is prefilled alongside in one chunk.
        max_batch_tokens = max_requests_per_batch + hints.expected_prompt_len
        if whole_prompts and hints.max_prompt_len is not None:
            # A prompt that may not be split fails in a forward too small for it.
            max_batch_tokens = max(max_batch_tokens, hints.max_prompt_len)
    return BatchingSizes(block_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                         max_requests_per_batch=max_requests_per_batch,
                         max_blocks_per_request=min(table_width, num_blocks))
