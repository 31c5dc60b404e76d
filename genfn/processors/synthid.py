"""SynthID-Text watermarking (Dathathri et al., Nature 2024): tournament-style reweighting by
pseudo-random g-values, and the mean-score detector.

For each candidate token, an n-gram hash of (the previous ``ngram_len - 1`` tokens, the token, a
key per depth) indexes a fixed random 0/1 table; each of the ``depth`` layers moves probability
mass towards tokens with g = 1. A context seen before (within ``context_history_size``) is left
unwatermarked, so repeated text does not compound the bias.

transformers keeps the context, the history of context hashes and a call counter inside the
processor object. Here they are an explicit :class:`SynthIDTextWatermarkState` pytree:
``state = processor.init_state(B)``, then ``logits, state = processor.apply(logits, ctx, state)``
every step. The hash arithmetic is int64 with wrap-around, exactly as transformers computes it,
so the g-values and the reweighted scores agree.
"""

from __future__ import annotations

from typing import Any

import torch

from genfn.processors.base import ProcessorBase, accepts_transformers_arguments, uses_keywords
from genfn.processors.context import LogitsContext
from genfn.state.base import pytree_dataclass, static_field

__all__ = [
    "SynthIDTextWatermarkState",
    "SynthIDTextWatermarkLogitsProcessor",
    "synthid_mean_score",
    "synthid_weighted_mean_score",
    "synthid_kwargs",
]

_MULTIPLIER = 6364136223846793005
_INCREMENT = 1


def _accumulate_hash(current: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """Fold the last axis of ``data`` into ``current``: ``h = (h + d) * M + 1`` per entry (int64 wrap)."""
    for i in range(data.shape[-1]):
        current = (current + data[..., i]) * _MULTIPLIER + _INCREMENT
    return current


def synthid_kwargs(config: Any) -> dict[str, Any]:
    """The settings of a ``SynthIDTextWatermarkingConfig`` (transformers', genfn's, or a dict)."""
    names = (
        "ngram_len",
        "keys",
        "sampling_table_size",
        "sampling_table_seed",
        "context_history_size",
        "skip_first_ngram_calls",
        "debug_mode",
    )
    defaults = (None, None, 2**16, 0, 1024, False, False)
    get = config.get if isinstance(config, dict) else (lambda n, d: getattr(config, n, d))
    return {n: get(n, d) for n, d in zip(names, defaults)}


@pytree_dataclass
class SynthIDTextWatermarkState:
    """What SynthID remembers between steps (one row per hypothesis)."""

    context: torch.Tensor  # [B, ngram_len - 1] int64: the previous tokens
    context_history: torch.Tensor  # [B, context_history_size] int64: hashes of recent contexts, newest first
    num_calls: torch.Tensor  # [B] int64: steps each row processed so far (rows may join a batch later)


@accepts_transformers_arguments(
    uses_keywords("sampling_table_size", "sampling_table_seed", "device", first_type=int),
    lambda cls, *args, **kwargs: cls.create(*args, **kwargs),
    lambda *args, **kwargs: {"device": kwargs.get("device", args[5] if len(args) > 5 else None), "state": None})
@pytree_dataclass
class SynthIDTextWatermarkLogitsProcessor(ProcessorBase):
    """Stateful SynthID processor. Build with :meth:`create`; ``keys`` and ``sampling_table`` are
    constant tensors (the table is drawn from ``torch.randint`` under ``sampling_table_seed``).

    Like transformers, the scores it returns are log-probabilities (``-inf`` replaced by the
    float32 minimum) for non-repeated contexts, and the incoming scores otherwise.
    """

    stateful = True

    keys: torch.Tensor  # [depth] int64
    sampling_table: torch.Tensor  # [sampling_table_size] int64 in {0, 1}
    ngram_len: int = static_field()
    context_history_size: int = static_field(1024)
    skip_first_ngram_calls: bool = static_field(False)
    debug_mode: bool = static_field(False)

    @classmethod
    def create(
        cls,
        ngram_len: int,
        keys: list[int],
        sampling_table_size: int = 2**16,
        sampling_table_seed: int = 0,
        context_history_size: int = 1024,
        device: Any = None,
        skip_first_ngram_calls: bool = False,
        debug_mode: bool = False,
    ) -> SynthIDTextWatermarkLogitsProcessor:
        device = torch.device(device if device is not None else "cpu")
        generator = torch.Generator(device=device).manual_seed(sampling_table_seed)
        table = torch.randint(0, 2, (sampling_table_size,), generator=generator, device=device)
        return cls(
            torch.tensor(list(keys), device=device),
            table,
            ngram_len,
            context_history_size,
            skip_first_ngram_calls,
            debug_mode,
        )

    @classmethod
    def from_config(cls, config: Any, device: Any = None) -> SynthIDTextWatermarkLogitsProcessor:
        return cls.create(**synthid_kwargs(config), device=device)

    # -- the step --------------------------------------------------------------------------------

    def init_state(self, batch_size: int, device: Any = None) -> SynthIDTextWatermarkState:
        device = self.keys.device if device is None else device
        return SynthIDTextWatermarkState(
            context=torch.zeros((batch_size, self.ngram_len - 1), dtype=torch.int64, device=device),
            context_history=torch.zeros((batch_size, self.context_history_size), dtype=torch.int64, device=device),
            num_calls=torch.zeros((batch_size,), dtype=torch.int64, device=device),
        )

    def apply(
        self, logits: torch.Tensor, ctx: LogitsContext, state: SynthIDTextWatermarkState
    ) -> tuple[torch.Tensor, SynthIDTextWatermarkState]:
        batch, vocab = logits.shape
        if self.debug_mode:
            logits = torch.ones_like(logits)
        # The first call keeps the zero context; later calls shift in the newest token. transformers
        # makes that first call with an empty ``input_ids`` (a static width: no token to read).
        newest = (ctx.last_token() if ctx.tokens.shape[1] else
                  torch.zeros(batch, dtype=torch.int64, device=logits.device))
        shifted = torch.cat([state.context, newest.to(state.context.device).unsqueeze(1)], dim=1)[:, 1:]
        num_calls = state.num_calls.reshape(-1, 1).expand(batch, 1)  # a 0-d count (older states) broadcasts
        context = torch.where(num_calls > 0, shifted, state.context)
        num_calls = num_calls + 1

        ngram_keys, context_hash = self._compute_keys(context, vocab)
        g_values = self.sample_g_values(ngram_keys)
        updated = self.update_scores(logits, g_values)
        context_hash = context_hash[:, None]
        repeated = (state.context_history == context_hash).any(dim=1, keepdim=True)
        history = torch.cat([context_hash, state.context_history], dim=1)[:, :-1]
        out = torch.where(repeated, logits, updated)

        if self.skip_first_ngram_calls:
            skip = num_calls < self.ngram_len
            out = torch.where(skip, logits, out)
            history = torch.where(skip, state.context_history, history)
        return out, SynthIDTextWatermarkState(context=context, context_history=history, num_calls=num_calls[:, 0])

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        raise TypeError(
            "SynthIDTextWatermarkLogitsProcessor is stateful: use `state = p.init_state(batch)` and "
            "`logits, state = p.apply(logits, ctx, state)`."
        )

    # -- pieces shared with detection ------------------------------------------------------------

    def _compute_keys(self, context: torch.Tensor, vocab: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([B, V, depth] n-gram keys for every candidate token, [B] hash of the context)``.

        ``vocab``: the vocabulary size (every token is a candidate), or, as transformers' method
        takes it, a ``[B, N]`` tensor of each row's candidate token ids."""
        batch = context.shape[0]
        ones = torch.ones(batch, device=context.device, dtype=torch.long)
        context_hash = _accumulate_hash(ones, context)
        if isinstance(vocab, torch.Tensor):
            candidates = vocab.to(device=context.device, dtype=torch.long)
        else:
            candidates = torch.arange(vocab, device=context.device)[None, :]
        per_token = (context_hash[:, None] + candidates) * _MULTIPLIER + _INCREMENT  # [B, V]
        keys = self.keys.to(context.device)
        per_key = (per_token[..., None] + keys) * _MULTIPLIER + _INCREMENT  # [B, V, depth]
        return per_key, context_hash

    def compute_ngram_keys(self, ngrams: torch.Tensor) -> torch.Tensor:
        """``ngrams [B, T, ngram_len]`` -> ``[B, T, depth]`` keys."""
        if ngrams.dim() != 3 or ngrams.shape[2] != self.ngram_len:
            raise ValueError(
                f"Ngrams should be of shape (batch_size, num_ngrams, {self.ngram_len}), but is {ngrams.shape}"
            )
        ones = torch.ones(ngrams.shape[:2], device=ngrams.device, dtype=torch.long)
        hashed = _accumulate_hash(ones, ngrams)
        keys = self.keys.to(ngrams.device)
        return (hashed[..., None] + keys) * _MULTIPLIER + _INCREMENT

    def sample_g_values(self, ngram_keys: torch.Tensor) -> torch.Tensor:
        table = self.sampling_table.to(ngram_keys.device)
        return table[ngram_keys % table.shape[0]]

    @staticmethod
    def update_scores(scores: torch.Tensor, g_values: torch.Tensor) -> torch.Tensor:
        """The tournament: ``depth`` rounds of ``p *= 1 + g - E_p[g]``, then log."""
        probs = torch.softmax(scores, dim=1)
        for i in range(g_values.shape[-1]):
            g = g_values[:, :, i]
            g_mass = (g * probs).sum(axis=1, keepdims=True)
            probs = probs * (1 + g - g_mass)
        log_probs = torch.log(probs)
        return torch.where(torch.isfinite(log_probs), log_probs, torch.finfo(log_probs.dtype).min)

    def compute_g_values(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T - ngram_len + 1, depth]`` g-values of every n-gram of a text."""
        return self.sample_g_values(self.compute_ngram_keys(input_ids.unfold(1, self.ngram_len, 1)))

    def compute_context_repetition_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T - ngram_len + 1]`` True where the n-gram's context was not among the previous
        ``context_history_size`` contexts (the initial history is zeros, as in generation)."""
        contexts = input_ids[:, :-1].unfold(1, self.ngram_len - 1, 1)  # [B, C, n - 1]
        batch, count = contexts.shape[:2]
        ones = torch.ones((batch, count), device=input_ids.device, dtype=torch.long)
        hashes = _accumulate_hash(ones, contexts)  # [B, C]
        idx = torch.arange(count, device=input_ids.device)
        lag = idx[:, None] - idx[None, :]  # i - j
        window = (lag >= 1) & (lag <= self.context_history_size)
        repeated = ((hashes[:, :, None] == hashes[:, None, :]) & window).any(dim=-1)
        # Slots not yet filled hold 0: a zero hash within the first H contexts also matches.
        repeated = repeated | ((hashes == 0) & (idx < self.context_history_size))
        return ~repeated

    @staticmethod
    def compute_eos_token_mask(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
        """``[B, T]`` 1 before the first EOS of each row, 0 from it on."""
        seen = (input_ids == eos_token_id).long().cumsum(dim=1) > 0
        return (~seen).to(input_ids.dtype)

    @staticmethod
    def expected_mean_g_value(vocab_size: int, coinflip_prob: float = 0.5) -> float:
        return coinflip_prob + coinflip_prob * (1 - coinflip_prob) * (1 - 1 / vocab_size)

    def detection_inputs(self, input_ids: torch.Tensor, eos_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g_values, mask)`` as transformers' ``SynthIDTextWatermarkDetector`` feeds its model."""
        mask = self.compute_context_repetition_mask(input_ids).to(input_ids.dtype)
        if eos_token_id is not None:
            mask = mask * self.compute_eos_token_mask(input_ids, eos_token_id)[:, self.ngram_len - 1 :]
        return self.compute_g_values(input_ids), mask


def synthid_mean_score(g_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` mean g-value over scored positions and depths (about 0.5 without a watermark)."""
    depth = g_values.shape[-1]
    total = (g_values * mask[..., None]).sum(dim=(-2, -1))
    return total / (depth * mask.sum(dim=-1))


def synthid_weighted_mean_score(
    g_values: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Like :func:`synthid_mean_score` with per-depth weights (default: linear 10 -> 1, as in the
    paper's reference code), rescaled to sum to ``depth``."""
    depth = g_values.shape[-1]
    if weights is None:
        weights = torch.linspace(10, 1, depth, device=g_values.device)
    weights = weights * (depth / weights.sum())
    total = (g_values * weights * mask[..., None]).sum(dim=(-2, -1))
    return total / (depth * mask.sum(dim=-1))
