"""User-facing stopping criteria, with transformers' names and semantics, and the adapter the
driver calls them through.

These run eagerly between steps (they may need Python: a clock, a user's function). Each is
called as ``criterion(input_ids [B, L], scores) -> [B] bool``, exactly like transformers'
``StoppingCriteria``, so transformers' own criteria objects work here unchanged, and so does any
plain callable of that shape. :func:`call_user_criteria` checks what they return.
"""

from __future__ import annotations

import abc
import copy
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from genfn.inputs import warn_beyond_context
from genfn.stopping.strings import (StopStringMatcher, build_stop_tables, matching_positions, stop_string_matching_mode,
                                    token_bytes)

__all__ = [
    "StoppingCriteria",
    "StoppingCriteriaList",
    "MaxLengthCriteria",
    "MaxTimeCriteria",
    "EosTokenCriteria",
    "ConfidenceCriteria",
    "StopStringCriteria",
    "validate_stopping_criteria",
    "call_user_criteria",
]


class StoppingCriteria(abc.ABC):
    """A user criterion: called with ``(input_ids [B, cur_len], scores)``, returns ``[B]`` bool.

    Same call signature as transformers' ``StoppingCriteria``; it runs eagerly between steps.
    ``scores`` is the latest step's processed scores ``[B, V]`` when ``output_scores`` is on,
    else None.
    """

    @abc.abstractmethod
    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs) -> torch.Tensor:
        """``[B]`` bool: which rows should stop."""


class StoppingCriteriaList(list):
    """A list of criteria; a row is done when any criterion says so."""

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs) -> torch.Tensor:
        return call_user_criteria(list(self), input_ids, scores, **kwargs)

    @property
    def max_length(self) -> int | None:
        """The ``max_length`` of the first :class:`MaxLengthCriteria` in the list, if any."""
        for criterion in self:
            if isinstance(criterion, MaxLengthCriteria) or _is_transformers(criterion, "MaxLengthCriteria"):
                return criterion.max_length
        return None


class MaxLengthCriteria(StoppingCriteria):
    """Stop once the sequences hold ``max_length`` tokens, prompt included.

    ``max_position_embeddings``: the model's context; running past it logs transformers' reminder
    (once) instead of failing, because some models extrapolate and some do not.
    """

    def __init__(self, max_length: int, max_position_embeddings: int | None = None):
        _check_positive_int("max_length", max_length)
        if max_position_embeddings is not None:
            _check_positive_int("max_position_embeddings", max_position_embeddings)
        self.max_length = max_length
        self.max_position_embeddings = max_position_embeddings

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs) -> torch.Tensor:
        cur_len = input_ids.shape[1]
        done = cur_len >= self.max_length
        if not done:
            warn_beyond_context(cur_len, self.max_position_embeddings)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class MaxTimeCriteria(StoppingCriteria):
    """Stop once more than ``max_time`` seconds passed since ``initial_timestamp`` (default: now,
    by ``time.time()``, as transformers counts it)."""

    def __init__(self, max_time: float, initial_timestamp: float | None = None):
        if isinstance(max_time, bool) or not isinstance(max_time, (int, float)) or not max_time >= 0:
            raise ValueError(f"`max_time` must be a number of seconds >= 0, got {max_time!r}")
        self.max_time = float(max_time)
        self.initial_timestamp = time.time() if initial_timestamp is None else float(initial_timestamp)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs) -> torch.Tensor:
        done = time.time() - self.initial_timestamp > self.max_time
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class EosTokenCriteria(StoppingCriteria):
    """Stop a row once one of its ``new_token_length`` newest tokens is an end-of-sequence id."""

    def __init__(self, eos_token_id: int | Sequence[int] | torch.Tensor):
        if isinstance(eos_token_id, torch.Tensor):
            ids = eos_token_id.reshape(-1)
            if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                raise TypeError(f"`eos_token_id` must hold integer token ids, got dtype {ids.dtype}")
        else:
            values = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
                raise TypeError(f"`eos_token_id` must be an int, a non-empty list of ints or a tensor, "
                                f"got {eos_token_id!r}")
            ids = torch.tensor(values, dtype=torch.int64)
        if ids.numel() and bool((ids < 0).any()):
            raise ValueError(f"`eos_token_id` must hold ids >= 0, got {ids.tolist()}")
        self.eos_token_id = ids

    def __call__(self, input_ids: torch.Tensor, scores: Any, new_token_length: int = 1, **kwargs) -> torch.Tensor:
        self.eos_token_id = self.eos_token_id.to(input_ids.device)
        return torch.isin(input_ids[:, -new_token_length:], self.eos_token_id).any(dim=-1)


class ConfidenceCriteria(StoppingCriteria):
    """Stop a row once the probability its latest scores gave its newest token is below
    ``assistant_confidence_threshold`` (how a draft model decides to stop proposing).

    Unlike transformers' version (batch 1, Python bool), every row gets its own answer.
    """

    def __init__(self, assistant_confidence_threshold: float):
        value = assistant_confidence_threshold
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"`assistant_confidence_threshold` must be a probability in [0, 1], got {value!r}")
        self.assistant_confidence_threshold = float(value)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs) -> torch.Tensor:
        latest = scores[-1] if isinstance(scores, (tuple, list)) and scores else scores
        if not isinstance(latest, torch.Tensor) or latest.dim() != 2:
            raise ValueError("ConfidenceCriteria needs the latest scores [batch, vocab]: generate with "
                             "return_dict_in_generate=True and output_scores=True")
        probs = latest.float().softmax(-1)
        newest = probs.gather(1, input_ids[:, -1:].to(probs.device)).squeeze(1)
        return (newest < self.assistant_confidence_threshold).to(input_ids.device)


class StopStringCriteria(StoppingCriteria):
    """Stop a row once its text ends with one of ``stop_strings``, across token boundaries.

    The eager face of :class:`~genfn.stopping.strings.StopStringMatcher`, which ``generate``
    evaluates inside the step; ``tokenizer`` is genfn's or transformers' tokenizer.
    """

    def __init__(self, tokenizer: Any, stop_strings: str | Sequence[str]):
        self.matcher = StopStringMatcher.from_tokenizer(tokenizer, stop_strings)
        self.stop_strings = self.matcher.stop_strings

    # transformers' private helpers, which its own tests call, answered from genfn's tables.
    _get_stop_string_matching_mode = staticmethod(stop_string_matching_mode)
    _token_to_bytes = staticmethod(token_bytes)

    @staticmethod
    def _stop_string_get_matching_positions(token_list, token_indices, stop_strings) -> tuple[dict, dict]:
        """``({stop: {token id: valid positions}}, {stop: {token id: end overlaps}})``."""
        positions, overlaps = matching_positions(list(zip(token_list, token_indices)), tuple(stop_strings))
        return dict(zip(stop_strings, positions)), dict(zip(stop_strings, overlaps))

    @staticmethod
    def _stop_string_create_embedding_vec(token_list, token_indices, stop_strings) -> tuple[torch.Tensor, int, int]:
        """genfn's three tables packed in transformers' one: per token row, each stop string's
        valid positions, then each one's end overlaps, then the token's length (``-1`` fillers)."""
        positions, ends, lengths = build_stop_tables(list(zip(token_list, token_indices)), tuple(stop_strings))
        flat = [positions[:, s] for s in range(positions.shape[1])] + [ends[:, s] for s in range(ends.shape[1])]
        return torch.cat([*flat, lengths.unsqueeze(1)], dim=1), positions.shape[2], ends.shape[2]

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs) -> torch.Tensor:
        if self.matcher.lengths.device != input_ids.device:
            self.matcher = self.matcher.to(input_ids.device)
        lengths = torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.int64, device=input_ids.device)
        return self.matcher(input_ids, lengths)


def validate_stopping_criteria(stopping_criteria: Sequence, max_length: int) -> StoppingCriteriaList:
    """A copy of ``stopping_criteria`` that also stops at ``max_length``, as transformers' does:
    a :class:`MaxLengthCriteria` is appended when there is none, and a different one only warns."""
    criteria = StoppingCriteriaList(copy.deepcopy(list(stopping_criteria)))
    own = criteria.max_length
    if own is None:
        criteria.append(MaxLengthCriteria(max_length=max_length))
    elif own != max_length:
        warnings.warn("You set different `max_length` for stopping criteria and `max_length` parameter", UserWarning,
                      stacklevel=2)
    return criteria


def call_user_criteria(criteria: Callable | Sequence[Callable], input_ids: torch.Tensor, scores: Any,
                       **kwargs) -> torch.Tensor:
    """``[B]`` bool: the rows any of ``criteria`` wants stopped.

    ``criteria`` is one criterion or a list of them: genfn's, transformers' (``StoppingCriteria``
    or ``StoppingCriteriaList``), or any callable ``(input_ids, scores) -> [B] bool``. A criterion
    may also answer with one bool for the whole batch (transformers' ``ConfidenceCriteria`` does).
    Anything else it returns is a ``TypeError`` that names it.
    """
    batch = input_ids.shape[0]
    done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    for criterion in _flatten(criteria):
        answer = criterion(input_ids, scores, **kwargs)
        done = done | _as_row_mask(answer, batch, criterion).to(done.device)
    return done


def _flatten(criteria: Any) -> list:
    # A StoppingCriteriaList (genfn's or transformers') is a callable list: call its members one
    # by one, so that a bad answer is blamed on the member that gave it.
    if isinstance(criteria, (list, tuple)):
        return [member for item in criteria for member in _flatten(item)]
    if callable(criteria):
        return [criteria]
    raise TypeError(f"`stopping_criteria` must be a callable (input_ids, scores) -> [batch] bool or a list of them, "
                    f"got {type(criteria).__name__} {criteria!r}"[:300])


def _as_row_mask(answer: Any, batch: int, criterion: Any) -> torch.Tensor:
    if isinstance(answer, bool):
        return torch.full((batch,), answer, dtype=torch.bool)
    if isinstance(answer, torch.Tensor) and answer.dtype == torch.bool:
        if answer.dim() == 0:
            return answer.expand(batch)
        if answer.dim() == 1 and answer.shape[0] == batch:
            return answer
        detail = f"a bool tensor of shape {list(answer.shape)}"
    elif isinstance(answer, torch.Tensor):
        detail = f"a tensor of dtype {answer.dtype}"
    else:
        detail = f"{type(answer).__name__} {answer!r}"[:200]
    raise TypeError(f"stopping criterion {_name_of(criterion)} must return a bool tensor of shape [{batch}] "
                    f"(one answer per row) or a bool, got {detail}")


def _name_of(criterion: Any) -> str:
    name = getattr(criterion, "__qualname__", None) or type(criterion).__qualname__
    return repr(name)


def _is_transformers(obj: Any, class_name: str) -> bool:
    return any(c.__name__ == class_name and c.__module__.startswith("transformers.") for c in type(obj).__mro__)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
