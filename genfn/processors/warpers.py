"""Sampling truncations ("warpers"): temperature, top-k/p/h, min-p, typical, epsilon, eta.

Each one equals its transformers counterpart op for op, so the float32 results agree bit for bit
on the same device: the same sorts, the same softmax/cumsum, the same comparisons with scalars
cast to float32. transformers only instantiates them when ``do_sample`` (see ``chain.py``).

Temperature, top-k, top-p and min-p also take a per-row ``[B]`` tensor instead of a Python
number, so a continuous batch can mix requests. A row whose value means "off" (temperature 1,
top_k <= 0, top_p >= 1, min_p == 0) is left untouched, the same as transformers not
instantiating the processor for that request.
"""

from __future__ import annotations

import torch

from genfn.processors.base import ProcessorBase
from genfn.processors.context import LogitsContext
from genfn.state.base import pytree_dataclass, static_field

__all__ = [
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "MinPLogitsWarper",
    "TopHLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
]

_NEG_INF = -float("inf")


def _check_min_tokens(min_tokens_to_keep: int) -> None:
    if not isinstance(min_tokens_to_keep, int) or min_tokens_to_keep < 1:
        raise ValueError(f"`min_tokens_to_keep` has to be a positive integer, but is {min_tokens_to_keep}")


def _row_param(value: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A ``[B]`` parameter as a ``[B, 1]`` column of ``dtype``."""
    if value.dim() != 1:
        raise ValueError(f"per-row parameters must be 1-D [batch], got shape {tuple(value.shape)}")
    return value.to(dtype)


def _kth_largest_threshold(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, 1]`` the k-th largest value per row (k already clamped to ``[1, V]``)."""
    return torch.topk(scores, k)[0][..., -1, None]


def _categorical_entropy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, entropy)`` computed exactly as ``torch.distributions.Categorical(logits=...)``.

    Written out because the distribution object validates its arguments with a host sync.
    """
    normalized = logits - logits.logsumexp(dim=-1, keepdim=True)
    probs = torch.softmax(normalized, dim=-1)
    clamped = torch.clamp(normalized, min=torch.finfo(normalized.dtype).min)
    entropy = -(clamped * probs).sum(-1)
    return probs, entropy


@pytree_dataclass
class TemperatureLogitsWarper(ProcessorBase):
    """``logits / temperature``; a float, or a ``[B]`` tensor for per-request temperatures."""

    temperature: float | torch.Tensor

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, torch.Tensor):
            _row_param(t)
            return
        if not isinstance(t, float) or not t > 0:
            msg = f"`temperature` (={t}) has to be a strictly positive float, otherwise the scores will be invalid."
            if isinstance(t, float) and t == 0.0:
                msg += " If you're looking for greedy decoding strategies, set `do_sample=False`."
            raise ValueError(msg)

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        t = self.temperature
        if isinstance(t, torch.Tensor):
            return logits / _row_param(t).to(logits.device).unsqueeze(1)
        return logits / t


@pytree_dataclass
class TopKLogitsWarper(ProcessorBase):
    """Keep the ``top_k`` largest logits (ties with the k-th are kept), at least ``min_tokens_to_keep``.

    ``top_k`` may be a ``[B]`` int tensor; rows with ``top_k <= 0`` are not truncated.
    """

    top_k: int | torch.Tensor
    filter_value: float = static_field(_NEG_INF)
    min_tokens_to_keep: int = static_field(1)

    def __post_init__(self):
        k = self.top_k
        if isinstance(k, torch.Tensor):
            _row_param(k, torch.int64)
        elif not isinstance(k, int) or k <= 0:
            raise ValueError(f"`top_k` has to be a strictly positive integer, but is {k}")

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        vocab = logits.shape[-1]
        k = self.top_k
        if not isinstance(k, torch.Tensor):
            k = min(max(k, self.min_tokens_to_keep), vocab)
            remove = logits < _kth_largest_threshold(logits, k)
            return logits.masked_fill(remove, self.filter_value)
        k = _row_param(k, torch.int64).to(logits.device)
        off = k <= 0
        k = torch.where(off, vocab, k.clamp(min=self.min_tokens_to_keep)).clamp(max=vocab)
        sorted_desc = torch.sort(logits, dim=-1, descending=True).values
        threshold = sorted_desc.gather(1, (k - 1).unsqueeze(1))
        remove = (logits < threshold) & ~off.unsqueeze(1)
        return logits.masked_fill(remove, self.filter_value)


@pytree_dataclass
class TopPLogitsWarper(ProcessorBase):
    """Nucleus: keep the smallest set of tokens whose probability mass exceeds ``top_p``.

    Removes, in ascending order, tokens while the cumulative mass is ``<= 1 - top_p``; the
    ``min_tokens_to_keep`` most likely are always kept. ``top_p`` may be a ``[B]`` tensor.
    """

    top_p: float | torch.Tensor
    filter_value: float = static_field(_NEG_INF)
    min_tokens_to_keep: int = static_field(1)

    def __post_init__(self):
        p = self.top_p
        if isinstance(p, torch.Tensor):
            _row_param(p, torch.float64)
        else:
            p = float(p)
            if p < 0 or p > 1.0:
                raise ValueError(f"`top_p` has to be a float > 0 and < 1, but is {p}")
            object.__setattr__(self, "top_p", p)
        _check_min_tokens(self.min_tokens_to_keep)

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        sorted_logits, sorted_indices = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        p = self.top_p
        if isinstance(p, torch.Tensor):
            # transformers compares float32 probabilities with float32(1 - top_p); do the
            # subtraction in float64 first, as Python does.
            p64 = _row_param(p, torch.float64).to(logits.device)
            threshold = (1 - p64).to(cumulative.dtype).unsqueeze(1)
            remove_sorted = (cumulative <= threshold) & (p64 < 1).unsqueeze(1)
        else:
            remove_sorted = cumulative <= 1 - p
        keep_tail = torch.arange(logits.shape[-1], device=logits.device) >= logits.shape[-1] - self.min_tokens_to_keep
        remove_sorted = remove_sorted & ~keep_tail
        remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
        return logits.masked_fill(remove, self.filter_value)


@pytree_dataclass
class MinPLogitsWarper(ProcessorBase):
    """Remove tokens whose probability is below ``min_p`` times the top probability.

    ``min_p`` may be a ``[B]`` tensor. The ``min_tokens_to_keep`` most likely tokens stay.
    """

    min_p: float | torch.Tensor
    filter_value: float = static_field(_NEG_INF)
    min_tokens_to_keep: int = static_field(1)

    def __post_init__(self):
        p = self.min_p
        if isinstance(p, torch.Tensor):
            _row_param(p)
        elif not 0 <= p <= 1.0:
            raise ValueError(f"`min_p` has to be a float in the [0, 1] interval, but is {p}")
        _check_min_tokens(self.min_tokens_to_keep)

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)
        top_probs = probs.amax(dim=-1, keepdim=True)
        p = self.min_p
        if isinstance(p, torch.Tensor):
            scaled = _row_param(p).to(logits.device).unsqueeze(1) * top_probs
        else:
            scaled = p * top_probs
        remove = probs < scaled
        k = min(self.min_tokens_to_keep, probs.shape[-1])
        kept = torch.topk(probs, k, dim=-1).indices
        remove = remove.scatter(-1, kept, False)
        return logits.masked_fill(remove, self.filter_value)


@pytree_dataclass
class TopHLogitsWarper(ProcessorBase):
    """Top-H: among the 100 most likely tokens, keep the prefix whose entropy mass stays within
    ``top_h`` times the entropy of that top-100 distribution (the first token always stays)."""

    top_h: float = static_field()
    filter_value: float = static_field(_NEG_INF)
    top_n: int = static_field(100)

    def __post_init__(self):
        if not 0 < self.top_h <= 1:
            raise ValueError("`top_h` must be in the range (0, 1].")

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        batch, vocab = logits.shape
        n = min(self.top_n, vocab)
        top_logits, top_idx = torch.topk(logits, n, dim=-1, largest=True, sorted=True)
        probs, entropy = _categorical_entropy(top_logits)
        tau = (entropy * self.top_h).unsqueeze(-1)
        cumulative = torch.cumsum(-probs * torch.log(probs), dim=-1)
        selected = cumulative <= tau
        first = torch.arange(n, device=logits.device) == 0
        selected = selected | first
        keep = torch.zeros((batch, vocab), dtype=torch.bool, device=logits.device)
        keep = keep.scatter(1, top_idx, selected)
        return logits.masked_fill(~keep, self.filter_value)


@pytree_dataclass
class TypicalLogitsWarper(ProcessorBase):
    """Locally typical sampling: keep the tokens whose surprisal is closest to the entropy, up to
    ``mass`` of probability."""

    mass: float = static_field(0.9)
    filter_value: float = static_field(_NEG_INF)
    min_tokens_to_keep: int = static_field(1)

    def __post_init__(self):
        mass = float(self.mass)
        if not (mass > 0 and mass < 1):
            raise ValueError(f"`typical_p` has to be a float > 0 and < 1, but is {mass}")
        object.__setattr__(self, "mass", mass)
        _check_min_tokens(self.min_tokens_to_keep)

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        normalized = torch.nn.functional.log_softmax(logits, dim=-1)
        p = torch.exp(normalized)
        ent = -(normalized * p).nansum(-1, keepdim=True)
        shifted = torch.abs(-normalized - ent)
        sorted_scores, sorted_indices = torch.sort(shifted, descending=False)
        sorted_logits = logits.gather(-1, sorted_indices)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        last_ind = (cumulative < self.mass).sum(dim=1).clamp(max=sorted_scores.shape[-1] - 1)
        remove_sorted = sorted_scores > sorted_scores.gather(1, last_ind.view(-1, 1))
        keep_head = torch.arange(logits.shape[-1], device=logits.device) < self.min_tokens_to_keep
        remove_sorted = remove_sorted & ~keep_head
        remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
        return logits.masked_fill(remove, self.filter_value)


def _validate_cutoff(warper, setting: str) -> None:
    """Epsilon and eta share their checks: a cutoff in (0, 1), and ``min_tokens_to_keep >= 1``."""
    eps = float(warper.epsilon)
    if eps <= 0 or eps >= 1:
        raise ValueError(f"`{setting}` has to be a float > 0 and < 1, but is {eps}")
    object.__setattr__(warper, "epsilon", eps)
    if int(warper.min_tokens_to_keep) < 1:
        raise ValueError(
            f"`min_tokens_to_keep` has to be a strictly positive integer, but is {warper.min_tokens_to_keep}"
        )
    object.__setattr__(warper, "min_tokens_to_keep", int(warper.min_tokens_to_keep))


@pytree_dataclass
class EpsilonLogitsWarper(ProcessorBase):
    """Epsilon sampling: drop tokens with probability below ``epsilon`` (keeping ``min_tokens_to_keep``)."""

    epsilon: float = static_field()
    filter_value: float = static_field(_NEG_INF)
    min_tokens_to_keep: int = static_field(1)

    def __post_init__(self):
        _validate_cutoff(self, "epsilon_cutoff")

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        remove = probs < self.epsilon
        k = min(self.min_tokens_to_keep, logits.size(-1))
        remove = remove & (logits < _kth_largest_threshold(logits, k))
        return logits.masked_fill(remove, self.filter_value)


@pytree_dataclass
class EtaLogitsWarper(ProcessorBase):
    """Eta sampling: an entropy-dependent epsilon, ``min(eta, sqrt(eta) * exp(-entropy))``."""

    epsilon: float = static_field()
    filter_value: float = static_field(_NEG_INF)
    min_tokens_to_keep: int = static_field(1)

    def __post_init__(self):
        _validate_cutoff(self, "eta_cutoff")

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        _, entropy = _categorical_entropy(logits)
        # transformers keeps epsilon as a float32 0-d tensor; sqrt/min happen in float32.
        eps = torch.full((), self.epsilon, dtype=torch.float32, device=logits.device)
        eta = torch.min(eps, torch.sqrt(eps) * torch.exp(-entropy))[..., None]
        remove = probs < eta
        k = min(self.min_tokens_to_keep, logits.size(-1))
        remove = remove & (logits < _kth_largest_threshold(logits, k))
        return logits.masked_fill(remove, self.filter_value)
