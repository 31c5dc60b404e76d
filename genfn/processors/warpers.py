"""Sampling truncations ("warpers"): temperature, top-k/p/h, min-p, typical, epsilon, eta.

Each one equals its transformers counterpart op for op, so the float32 results agree bit for bit
on the same device: the same sorts, the same softmax/cumsum, the same comparisons with scalars
cast to float32. transformers only instantiates them when ``do_sample`` (see ``chain.py``).

Every number is a per-row value: a Python number as in transformers, or (after ``per_row``) a
``[B]`` tensor, so a continuous batch can mix requests. A row whose value means "off"
(temperature 1, top_k 0, top_p 1, min_p 0, top_h 0, typical_p 1, epsilon/eta 0) is left
untouched, the same as transformers not instantiating the processor for that request.
"""

from __future__ import annotations

import torch

from genfn.processors.base import ProcessorBase, per_row_column, takes_device
from genfn.processors.context import LogitsContext
from genfn.processors.rowvalues import RowValue
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
_F32 = torch.float32


def _check_min_tokens(min_tokens_to_keep: int) -> None:
    if isinstance(min_tokens_to_keep, bool) or not isinstance(min_tokens_to_keep, int) or min_tokens_to_keep < 1:
        raise ValueError(f"`min_tokens_to_keep` has to be a positive integer, but is {min_tokens_to_keep}")


def _check_row_tensor(value: torch.Tensor, name: str) -> None:
    if value.dim() != 1:
        raise ValueError(f"per-row `{name}` must be 1-D [batch], got shape {tuple(value.shape)}")


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


def _row_is(value, test, device: torch.device) -> torch.Tensor:
    """``test(value)`` as a ``[B, 1]`` mask for a per-row tensor, a 0-d bool tensor for a number."""
    if isinstance(value, torch.Tensor):
        return test(value.to(device)).reshape(-1, 1)
    return torch.tensor(bool(test(value)), device=device)


@pytree_dataclass
class TemperatureLogitsWarper(ProcessorBase):
    """``logits / temperature``; a float, or a ``[B]`` tensor for per-request temperatures."""

    row_values = {"temperature": RowValue(_F32, 1.0)}

    temperature: float | torch.Tensor

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, torch.Tensor):
            _check_row_tensor(t, "temperature")
            return
        if not isinstance(t, float) or not t > 0:
            msg = f"`temperature` (={t}) has to be a strictly positive float, otherwise the scores will be invalid."
            if isinstance(t, float) and t == 0.0:
                msg += " If you're looking for greedy decoding strategies, set `do_sample=False`."
            raise ValueError(msg)

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        return logits / per_row_column(self.temperature, _F32, logits.device)


@pytree_dataclass
class TopKLogitsWarper(ProcessorBase):
    """Keep the ``top_k`` largest logits (ties with the k-th are kept), at least ``min_tokens_to_keep``.

    ``top_k`` may be a ``[B]`` int tensor; rows with ``top_k <= 0`` are not truncated.
    """

    row_values = {"top_k": RowValue(torch.int64, 0)}

    top_k: int | torch.Tensor
    filter_value: float = static_field(_NEG_INF)
    min_tokens_to_keep: int = static_field(1)

    def __post_init__(self):
        k = self.top_k
        if isinstance(k, torch.Tensor):
            _check_row_tensor(k, "top_k")
        elif isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"`top_k` has to be a strictly positive integer, but is {k}")

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        vocab = logits.shape[-1]
        k = self.top_k
        if not isinstance(k, torch.Tensor):
            k = min(max(k, self.min_tokens_to_keep), vocab)
            remove = logits < _kth_largest_threshold(logits, k)
            return logits.masked_fill(remove, self.filter_value)
        k = k.to(device=logits.device, dtype=torch.int64)
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
    ``min_tokens_to_keep`` most likely are always kept. ``top_p`` may be a ``[B]`` tensor (float64:
    ``1 - top_p`` is computed in double before the float32 comparison, as Python does).
    """

    row_values = {"top_p": RowValue(torch.float64, 1.0)}

    top_p: float | torch.Tensor
    filter_value: float = static_field(_NEG_INF)
    min_tokens_to_keep: int = static_field(1)

    def __post_init__(self):
        p = self.top_p
        if isinstance(p, torch.Tensor):
            _check_row_tensor(p, "top_p")
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
            p64 = p.to(device=logits.device, dtype=torch.float64)
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

    row_values = {"min_p": RowValue(_F32, 0.0)}

    min_p: float | torch.Tensor
    filter_value: float = static_field(_NEG_INF)
    min_tokens_to_keep: int = static_field(1)

    def __post_init__(self):
        p = self.min_p
        if isinstance(p, torch.Tensor):
            _check_row_tensor(p, "min_p")
        elif not 0 <= p <= 1.0:
            raise ValueError(f"`min_p` has to be a float in the [0, 1] interval, but is {p}")
        _check_min_tokens(self.min_tokens_to_keep)

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)
        top_probs = probs.amax(dim=-1, keepdim=True)
        scaled = per_row_column(self.min_p, _F32, logits.device) * top_probs
        remove = probs < scaled
        k = min(self.min_tokens_to_keep, probs.shape[-1])
        kept = torch.topk(probs, k, dim=-1).indices
        remove = remove.scatter(-1, kept, False)
        return logits.masked_fill(remove, self.filter_value)


@pytree_dataclass
class TopHLogitsWarper(ProcessorBase):
    """Top-H: among the 100 most likely tokens, keep the prefix whose entropy mass stays within
    ``top_h`` times the entropy of that top-100 distribution (the first token always stays).

    Per row, ``top_h == 0`` (outside the valid range ``(0, 1]``) means off.
    """

    row_values = {"top_h": RowValue(_F32, 0.0)}

    top_h: float | torch.Tensor
    filter_value: float = static_field(_NEG_INF)
    top_n: int = static_field(100)

    def __post_init__(self):
        if isinstance(self.top_h, torch.Tensor):
            _check_row_tensor(self.top_h, "top_h")
        elif not 0 < self.top_h <= 1:
            raise ValueError("`top_h` must be in the range (0, 1].")

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        batch, vocab = logits.shape
        n = min(self.top_n, vocab)
        top_logits, top_idx = torch.topk(logits, n, dim=-1, largest=True, sorted=True)
        probs, entropy = _categorical_entropy(top_logits)
        tau = entropy.unsqueeze(-1) * per_row_column(self.top_h, _F32, logits.device)
        cumulative = torch.cumsum(-probs * torch.log(probs), dim=-1)
        selected = cumulative <= tau
        first = torch.arange(n, device=logits.device) == 0
        selected = selected | first
        keep = torch.zeros((batch, vocab), dtype=torch.bool, device=logits.device)
        keep = keep.scatter(1, top_idx, selected)
        keep = keep | _row_is(self.top_h, lambda h: h <= 0, logits.device)
        return logits.masked_fill(~keep, self.filter_value)


@pytree_dataclass
class TypicalLogitsWarper(ProcessorBase):
    """Locally typical sampling: keep the tokens whose surprisal is closest to the entropy, up to
    ``mass`` of probability. Per row, ``mass >= 1`` means off."""

    row_values = {"mass": RowValue(_F32, 1.0)}

    mass: float | torch.Tensor = 0.9
    filter_value: float = static_field(_NEG_INF)
    min_tokens_to_keep: int = static_field(1)

    def __post_init__(self):
        if isinstance(self.mass, torch.Tensor):
            _check_row_tensor(self.mass, "typical_p")
        else:
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
        mass = per_row_column(self.mass, _F32, logits.device)
        last_ind = (cumulative < mass).sum(dim=1).clamp(max=sorted_scores.shape[-1] - 1)
        remove_sorted = sorted_scores > sorted_scores.gather(1, last_ind.view(-1, 1))
        keep_head = torch.arange(logits.shape[-1], device=logits.device) < self.min_tokens_to_keep
        remove_sorted = remove_sorted & ~keep_head & ~_row_is(self.mass, lambda m: m >= 1, logits.device)
        remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
        return logits.masked_fill(remove, self.filter_value)


def _validate_cutoff(warper, setting: str) -> None:
    """Epsilon and eta share their checks: a cutoff in (0, 1), and ``min_tokens_to_keep >= 1``."""
    if isinstance(warper.epsilon, torch.Tensor):
        _check_row_tensor(warper.epsilon, setting)
    else:
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
    """Epsilon sampling: drop tokens with probability below ``epsilon`` (keeping ``min_tokens_to_keep``).

    Per row, ``epsilon == 0`` removes nothing (off)."""

    row_values = {"epsilon": RowValue(_F32, 0.0)}

    epsilon: float | torch.Tensor
    filter_value: float = static_field(_NEG_INF)
    min_tokens_to_keep: int = static_field(1)

    def __post_init__(self):
        _validate_cutoff(self, "epsilon_cutoff")

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        remove = probs < per_row_column(self.epsilon, _F32, logits.device)
        k = min(self.min_tokens_to_keep, logits.size(-1))
        remove = remove & (logits < _kth_largest_threshold(logits, k))
        return logits.masked_fill(remove, self.filter_value)


@takes_device
@pytree_dataclass
class EtaLogitsWarper(ProcessorBase):
    """Eta sampling: an entropy-dependent epsilon, ``min(eta, sqrt(eta) * exp(-entropy))``.

    Per row, ``epsilon == 0`` gives a zero cutoff (off)."""

    row_values = {"epsilon": RowValue(_F32, 0.0)}

    epsilon: float | torch.Tensor
    filter_value: float = static_field(_NEG_INF)
    min_tokens_to_keep: int = static_field(1)

    def __post_init__(self):
        _validate_cutoff(self, "eta_cutoff")

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        _, entropy = _categorical_entropy(logits)
        # transformers keeps epsilon as a float32 0-d tensor; sqrt/min happen in float32.
        eps = self.epsilon
        if isinstance(eps, torch.Tensor):
            eps = eps.to(device=logits.device, dtype=_F32)
        else:
            eps = torch.full((), eps, dtype=_F32, device=logits.device)
        eta = torch.min(eps, torch.sqrt(eps) * torch.exp(-entropy))[..., None]
        remove = probs < eta
        k = min(self.min_tokens_to_keep, logits.size(-1))
        remove = remove & (logits < _kth_largest_threshold(logits, k))
        return logits.masked_fill(remove, self.filter_value)
