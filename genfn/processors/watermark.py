"""Green-list watermarking (Kirchenbauer et al., 2023) and its z-test detector.

transformers draws each row's green list with ``torch.randperm(V, generator=g)`` after seeding
``g`` from the previous token(s), one row at a time. The permutation is whatever torch's
randperm produces for that seed on that device (CPU and CUDA use different generators and
algorithms), so the only way to be *exact* everywhere is to call randperm itself. genfn splits
the computation in two:

* the **seeds** are computed in the graph, vectorized over the batch (integer hashing that wraps
  exactly like transformers' int64 arithmetic);
* the **seed -> green list** map is the custom op ``genfn::watermark_greenlists``, which calls
  randperm per distinct seed (with an LRU cache). A custom op is opaque to dynamo, so the
  processor traces under ``torch.compile(fullgraph=True)`` without a graph break; the op syncs
  with the host internally, so it is not CUDA-graph friendly.

For small vocabularies the lefthash scheme can also precompute every green list (``[V, G]``,
``precompute_greenlists=True``): the processor is then a pure gather inside the graph.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from genfn.processors.base import (ProcessorBase, accepts_transformers_arguments, per_row_column, tail_tokens,
                                   token_set_mask, uses_keywords)
from genfn.processors.context import LogitsContext
from genfn.processors.rowvalues import RowValue
from genfn.state.base import pytree_dataclass, static_field

__all__ = [
    "WatermarkLogitsProcessor",
    "WatermarkDetector",
    "WatermarkDetectorOutput",
    "greenlist_ids",
    "watermarking_kwargs",
]

_TABLE_SIZE = 1_000_003  # transformers' fixed hashing table for selfhash
_SELFHASH_CANDIDATES = 40  # transformers scores the 40 most likely tokens under selfhash
_SEED_MOD = 2**64 - 1


@functools.lru_cache(maxsize=256)
def _greenlist_cached(seed: int, vocab_size: int, greenlist_size: int, device: str) -> torch.Tensor:
    """Cached (as int32, to bound the memory of large vocabularies) and never handed out."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % _SEED_MOD)
    perm = torch.randperm(vocab_size, device=device, generator=generator)
    return perm[:greenlist_size].to(torch.int32)


def greenlist_ids(seed: int, vocab_size: int, greenlist_size: int, device: Any = "cpu") -> torch.Tensor:
    """``[G]`` the green list transformers draws after ``manual_seed(seed % (2**64 - 1))``."""
    cached = _greenlist_cached(int(seed), int(vocab_size), int(greenlist_size), str(torch.device(device)))
    return cached.to(torch.int64)


@torch.library.custom_op("genfn::watermark_greenlists", mutates_args=())
def _watermark_greenlists(seeds: torch.Tensor, vocab_size: int, greenlist_size: int) -> torch.Tensor:
    """``seeds [...]`` int64 -> ``[..., G]`` int64 green lists (exact torch.randperm per seed)."""
    flat = seeds.reshape(-1).tolist()
    device = str(seeds.device)
    if not flat:
        return seeds.new_empty((*seeds.shape, greenlist_size))
    rows = [_greenlist_cached(s, vocab_size, greenlist_size, device) for s in flat]
    return torch.stack(rows).to(torch.int64).reshape(*seeds.shape, greenlist_size)


@_watermark_greenlists.register_fake
def _(seeds: torch.Tensor, vocab_size: int, greenlist_size: int) -> torch.Tensor:
    return seeds.new_empty((*seeds.shape, greenlist_size))


def watermarking_kwargs(config: Any) -> dict[str, Any]:
    """The five settings of a ``WatermarkingConfig`` (transformers', genfn's, or a dict)."""
    names = ("greenlist_ratio", "bias", "hashing_key", "seeding_scheme", "context_width")
    defaults = (0.25, 2.0, 15485863, "lefthash", 1)
    if isinstance(config, dict):
        return {n: config.get(n, d) for n, d in zip(names, defaults)}
    return {n: getattr(config, n, d) for n, d in zip(names, defaults)}


def _fixed_table(hashing_key: int, device: Any) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed(hashing_key)
    return torch.randperm(_TABLE_SIZE, generator=generator, device=device)


def _selfhash_seeds(window: torch.Tensor, table: torch.Tensor, hashing_key: int) -> torch.Tensor:
    """Seeds for windows ``[..., w]`` whose last entry is the scored token (int64, wrapping)."""
    a = table[window % _TABLE_SIZE] + 1
    b = table[window[..., -1:] % _TABLE_SIZE] + 1
    return (hashing_key * a * b).min(dim=-1).values


@accepts_transformers_arguments(
    uses_keywords("device", "greenlist_ratio", "hashing_key"),
    lambda cls, *args, **kwargs: cls.create(*args, **kwargs),
    lambda vocab_size, device=None, greenlist_ratio=0.25, bias=2.0, hashing_key=15485863, *rest, **kwargs: {
        "hash_key": hashing_key, "table_size": _TABLE_SIZE})
@pytree_dataclass
class WatermarkLogitsProcessor(ProcessorBase):
    """Add ``bias`` to the logits of a pseudo-random "green" fraction of the vocabulary.

    ``lefthash``: the green list is seeded by the previous token. ``selfhash``: each of the 40 most
    likely candidates is kept green only if it is in the green list seeded by the context *and
    itself*. Nothing happens while the sequence is shorter than ``context_width``. ``bias`` is a
    per-row value (0: the row is not marked).

    Build with :meth:`create`; ``fixed_table`` (selfhash) and ``green_table`` (precomputed
    lefthash) are constant tensors made there.
    """

    row_values = {"bias": RowValue(torch.float32, 0.0)}

    vocab_size: int = static_field()
    greenlist_size: int = static_field()
    bias: float | torch.Tensor  # per row: 0 leaves the row unmarked
    hashing_key: int = static_field()
    seeding_scheme: str = static_field()
    context_width: int = static_field()
    fixed_table: torch.Tensor | None = None
    green_table: torch.Tensor | None = None

    @classmethod
    def create(
        cls,
        vocab_size: int,
        device: Any = None,
        greenlist_ratio: float = 0.25,
        bias: float = 2.0,
        hashing_key: int = 15485863,
        seeding_scheme: str = "lefthash",
        context_width: int = 1,
        precompute_greenlists: bool = False,
    ) -> WatermarkLogitsProcessor:
        if seeding_scheme not in ("selfhash", "lefthash"):
            raise ValueError(f"seeding_scheme has to be one of [`selfhash`, `lefthash`], but found {seeding_scheme}")
        if greenlist_ratio >= 1.0 or greenlist_ratio <= 0.0:
            raise ValueError(
                "greenlist_ratio has be in range between 0.0 and 1.0, exclusively. but found " f"{greenlist_ratio}"
            )
        device = torch.device(device if device is not None else "cpu")
        greenlist_size = int(vocab_size * greenlist_ratio)
        fixed_table = _fixed_table(hashing_key, device) if seeding_scheme == "selfhash" else None
        green_table = None
        if precompute_greenlists:
            if seeding_scheme != "lefthash":
                raise ValueError("precompute_greenlists is only possible for the lefthash scheme")
            seeds = hashing_key * torch.arange(vocab_size, dtype=torch.int64, device=device)
            green_table = _watermark_greenlists(seeds, vocab_size, greenlist_size)
        return cls(
            vocab_size, greenlist_size, bias, hashing_key, seeding_scheme, context_width, fixed_table, green_table
        )

    def _greenlists(self, seeds: torch.Tensor) -> torch.Tensor:
        return _watermark_greenlists(seeds, self.vocab_size, self.greenlist_size)

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        vocab = logits.shape[-1]
        if self.seeding_scheme == "lefthash":
            last = ctx.last_token()
            if self.green_table is not None:
                green_ids = self.green_table.to(logits.device)[last]
            else:
                green_ids = self._greenlists(self.hashing_key * last)
            green = token_set_mask(green_ids, vocab)
        else:
            k = min(_SELFHASH_CANDIDATES, vocab)
            candidates = logits.sort(dim=-1, descending=True).indices[:, :k]  # [B, K]
            context = tail_tokens(ctx, self.context_width - 1)  # [B, w - 1]
            windows = torch.cat([context.unsqueeze(1).expand(-1, k, -1), candidates.unsqueeze(-1)], dim=-1)
            seeds = _selfhash_seeds(windows, self.fixed_table.to(logits.device), self.hashing_key)
            in_own_list = (self._greenlists(seeds) == candidates.unsqueeze(-1)).any(dim=-1)  # [B, K]
            green = torch.zeros_like(logits, dtype=torch.bool).scatter(1, candidates, in_own_list)
        marked = torch.where(green, logits + per_row_column(self.bias, logits.dtype, logits.device), logits)
        return torch.where((ctx.row_cur_len() < self.context_width).unsqueeze(1), logits, marked)


@dataclasses.dataclass(frozen=True)
class WatermarkDetectorOutput:
    """Per-row detection statistics (float64 tensors; ``prediction`` is bool)."""

    num_tokens_scored: torch.Tensor
    num_green_tokens: torch.Tensor
    green_fraction: torch.Tensor
    z_score: torch.Tensor
    p_value: torch.Tensor
    prediction: torch.Tensor
    confidence: torch.Tensor


class WatermarkDetector:
    """One-proportion z-test on the fraction of green tokens in a text.

    Mirrors transformers' ``WatermarkDetector``: a leading BOS column is dropped, every n-gram
    (the scored token and its seeding context) is scored, optionally counting repeated n-grams
    once (``ignore_repeated_ngrams``). The z-score is ``(green - r T) / sqrt(T r (1 - r))`` and the
    p-value its one-sided normal tail. An eager tool (it returns numbers for a whole text).
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        bos_token_id: int | None = None,
        greenlist_ratio: float = 0.25,
        bias: float = 2.0,
        hashing_key: int = 15485863,
        seeding_scheme: str = "lefthash",
        context_width: int = 1,
        ignore_repeated_ngrams: bool = False,
        device: Any = None,
    ):
        self.bos_token_id = bos_token_id
        self.greenlist_ratio = greenlist_ratio
        self.ignore_repeated_ngrams = ignore_repeated_ngrams
        self.processor = WatermarkLogitsProcessor.create(
            vocab_size,
            device=device,
            greenlist_ratio=greenlist_ratio,
            bias=bias,
            hashing_key=hashing_key,
            seeding_scheme=seeding_scheme,
            context_width=context_width,
        )

    @classmethod
    def from_config(cls, vocab_size: int, watermarking_config: Any, **kwargs: Any) -> WatermarkDetector:
        return cls(vocab_size, **watermarking_kwargs(watermarking_config), **kwargs)

    def green_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, W]`` bool: whether the last token of each scored n-gram is green."""
        p = self.processor
        selfhash = p.seeding_scheme == "selfhash"
        n = p.context_width + 1 - int(selfhash)
        ngrams = input_ids.unfold(1, n, 1)  # [B, W, n]
        target = ngrams[..., -1]
        if selfhash:
            window = ngrams[..., -p.context_width :]
            seeds = _selfhash_seeds(window, p.fixed_table.to(input_ids.device), p.hashing_key)
        else:
            seeds = p.hashing_key * ngrams[..., -2]
        lists = _watermark_greenlists(seeds, p.vocab_size, p.greenlist_size)
        return (lists == target.unsqueeze(-1)).any(dim=-1)

    def __call__(
        self, input_ids: torch.Tensor, z_threshold: float = 3.0, return_dict: bool = False
    ) -> WatermarkDetectorOutput | torch.Tensor:
        if self.bos_token_id is not None:
            has_bos = input_ids[:, 0] == self.bos_token_id
            if bool(has_bos.any()) != bool(has_bos.all()):
                raise ValueError(
                    "Some batch contains inconsistent leading BOS token. Make sure to prepare input with the same "
                    "tokenization parameters."
                )
            if bool(has_bos[0]):
                input_ids = input_ids[:, 1:]
        if input_ids.shape[-1] - self.processor.context_width < 1:
            raise ValueError(
                "Must have at least `1` token to score after the first "
                f"min_prefix_len={self.processor.context_width} tokens required by the seeding scheme."
            )
        green = self.green_mask(input_ids)
        if self.ignore_repeated_ngrams:
            n = input_ids.shape[1] - green.shape[1] + 1
            ngrams = input_ids.unfold(1, n, 1)
            same = (ngrams.unsqueeze(2) == ngrams.unsqueeze(1)).all(dim=-1)  # [B, W, W]
            earlier = torch.ones(same.shape[1:], dtype=torch.bool, device=same.device).tril(-1)
            first = ~(same & earlier).any(dim=-1)
            total = first.sum(dim=-1).double()
            green_count = (green & first).sum(dim=-1).double()
        else:
            total = torch.full((green.shape[0],), float(green.shape[1]), dtype=torch.float64)
            green_count = green.sum(dim=-1).double()
        total, green_count = total.cpu(), green_count.cpu()
        r = self.greenlist_ratio
        z = (green_count - r * total) / torch.sqrt(total * r * (1 - r))
        prediction = z > z_threshold
        if not return_dict:
            return prediction
        p_value = 0.5 * torch.special.erfc(z / math.sqrt(2))
        return WatermarkDetectorOutput(
            num_tokens_scored=total,
            num_green_tokens=green_count,
            green_fraction=green_count / total,
            z_score=z,
            p_value=p_value,
            prediction=prediction,
            confidence=1 - p_value,
        )
