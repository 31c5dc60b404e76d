"""Value checks for config fields.

Each checker is ``check(name, value)``: it returns None or raises TypeError (wrong kind of value) /
ValueError (right kind, outside the allowed set), always naming the field, so every config class
reports bad input the same way.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

__all__ = ["normalize_sequence_bias"]

Checker = Callable[[str, Any], None]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def type_error(name: str, expected: str, value: Any) -> NoReturn:
    raise TypeError(f"`{name}` must be {expected}, got {_show(value)} (type {type(value).__name__}).")


def value_error(name: str, expected: str, value: Any) -> NoReturn:
    raise ValueError(f"`{name}` must be {expected}, got {_show(value)}.")


def is_int(value: Any) -> bool:
    """Integers, numpy integers included; never bools (``True`` is not a token count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """Ints or floats (JSON writes ``1.0`` as ``1`` at times); never bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        type_error(name, "a bool (True or False)", value)


def check_optional_bool(name: str, value: Any) -> None:
    if value is not None:
        check_bool(name, value)


def int_check(minimum: int | None = None, maximum: int | None = None) -> Checker:
    if minimum is not None and maximum is not None:
        expected = f"an int in [{minimum}, {maximum}]"
    elif minimum is not None:
        expected = f"an int >= {minimum}"
    else:
        expected = "an int"

    def check(name: str, value: Any) -> None:
        if not is_int(value):
            type_error(name, expected, value)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            value_error(name, expected, value)

    return check


@dataclass(frozen=True)
class Interval:
    """A real interval, printed the way the error messages show it: ``(0.0, 1.0]``."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def contains(self, x: float) -> bool:
        above = x > self.low if self.low_open else x >= self.low
        below = x < self.high if self.high_open else x <= self.high
        return above and below

    def describe(self) -> str:
        """``a number in (0.0, 1.0]``, ``a number > 0.0``... for error messages."""
        if math.isinf(self.low) and math.isinf(self.high):
            return "a number"
        if math.isinf(self.high):
            return f"a number {'>' if self.low_open else '>='} {self.low}"
        if math.isinf(self.low):
            return f"a number {'<' if self.high_open else '<='} {self.high}"
        left = "(" if self.low_open else "["
        right = ")" if self.high_open else "]"
        return f"a number in {left}{self.low}, {self.high}{right}"


def real_check(interval: Interval = Interval(), allow_inf: bool = False) -> Checker:
    expected = interval.describe() if allow_inf else interval.describe().replace("a number", "a finite number")

    def check(name: str, value: Any) -> None:
        if not is_real(value):
            type_error(name, expected, value)
        try:
            x = float(value)
        except OverflowError:
            value_error(name, expected, value)
        if math.isnan(x) or (math.isinf(x) and not allow_inf) or not interval.contains(x):
            value_error(name, expected, value)

    return check


def optional(check: Checker) -> Checker:
    def optional_check(name: str, value: Any) -> None:
        if value is not None:
            check(name, value)

    return optional_check


def choice_check(choices: tuple[str, ...]) -> Checker:
    expected = "one of " + ", ".join(repr(choice) for choice in choices)

    def check(name: str, value: Any) -> None:
        if not isinstance(value, str):
            type_error(name, expected, value)
        if value not in choices:
            value_error(name, expected, value)

    return check


def check_mapping(name: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        type_error(name, "a dict", value)


def check_token_id(name: str, value: Any) -> None:
    if not is_int(value):
        type_error(name, "a token id (int)", value)


def check_token_ids(name: str, value: Any) -> None:
    """One token id, or a non-empty list of them (several EOS tokens, per-row start tokens)."""
    expected = "a token id (int) or a non-empty list of token ids"
    if is_int(value):
        return
    if not is_sequence(value) or not all(is_int(token) for token in value):
        type_error(name, expected, value)
    if len(value) == 0:
        value_error(name, expected, value)


def check_token_list(name: str, value: Any) -> None:
    """A possibly empty list of token ids (suppression lists)."""
    if not is_sequence(value) or not all(is_int(token) for token in value):
        type_error(name, "a list of token ids (ints)", value)


def check_bad_words_ids(name: str, value: Any) -> None:
    expected = "a non-empty list of non-empty lists of token ids (ints >= 0)"
    if not is_sequence(value) or not all(
        is_sequence(words) and all(is_int(token) for token in words) for words in value
    ):
        type_error(name, expected, value)
    if len(value) == 0 or any(len(words) == 0 or min(words) < 0 for words in value):
        value_error(name, expected, value)


_TUPLE_KEY = re.compile(r"^\(\s*(\d+\s*(,\s*\d+\s*)*,?\s*)?\)$")


def _sequence_key(key: Any) -> tuple[int, ...] | None:
    """A ``sequence_bias`` key as a tuple of ints, or None if it is not one.

    JSON cannot hold tuple keys, so transformers writes ``{(1, 2): b}`` as ``{"(1, 2)": b}``;
    accepting that spelling is what lets such a file load again.
    """
    if isinstance(key, tuple):
        return key if all(is_int(token) for token in key) else None
    if isinstance(key, str) and _TUPLE_KEY.match(key):
        return tuple(int(part) for part in key.strip("() ").split(",") if part.strip())
    return None


def normalize_sequence_bias(sequence_bias: Any, name: str = "sequence_bias") -> dict[tuple[int, ...], float]:
    """``sequence_bias`` in any accepted spelling, as ``{tuple of token ids: float bias}``.

    Accepted spellings: ``{(1, 2): 1.5}``, ``{"(1, 2)": 1.5}`` (what JSON round trips make of it),
    and ``[[[1, 2], 1.5], ...]`` (transformers' JSON-friendly list form). Raises TypeError /
    ValueError naming ``name`` for anything else, so processors can rely on the result.
    """
    expected = (
        "a non-empty dict {tuple of token ids: float} or a non-empty list of "
        "[list of token ids, float] pairs, with token ids >= 0"
    )
    if isinstance(sequence_bias, Mapping):
        pairs = [(_sequence_key(key), bias) for key, bias in sequence_bias.items()]
    elif is_sequence(sequence_bias) and all(is_sequence(item) and len(item) == 2 for item in sequence_bias):
        pairs = [
            (tuple(item[0]) if is_sequence(item[0]) and all(is_int(t) for t in item[0]) else None, item[1])
            for item in sequence_bias
        ]
    else:
        type_error(name, expected, sequence_bias)
    if any(tokens is None or not is_real(bias) for tokens, bias in pairs):
        type_error(name, expected, sequence_bias)
    if (
        len(pairs) == 0
        or any(len(tokens) == 0 or min(tokens) < 0 for tokens, _ in pairs)
        or any(not math.isfinite(float(bias)) for _, bias in pairs)
    ):
        value_error(name, expected, sequence_bias)
    return {tuple(int(t) for t in tokens): float(bias) for tokens, bias in pairs}


def check_sequence_bias(name: str, value: Any) -> None:
    normalize_sequence_bias(value, name)


def check_exponential_decay(name: str, value: Any) -> None:
    expected = "a (start_index, decay_factor) pair of an int >= 0 and a finite number"
    if not is_sequence(value) or len(value) != 2 or not is_int(value[0]) or not is_real(value[1]):
        type_error(name, expected, value)
    if value[0] < 0 or not math.isfinite(float(value[1])):
        value_error(name, expected, value)


def check_stop_strings(name: str, value: Any) -> None:
    expected = "a non-empty string or a non-empty list of non-empty strings"
    strings = [value] if isinstance(value, str) else value
    if not is_sequence(strings) or not all(isinstance(s, str) for s in strings):
        type_error(name, expected, value)
    if len(strings) == 0 or not all(strings):
        value_error(name, expected, value)


def check_early_stopping(name: str, value: Any) -> None:
    expected = "True, False or 'never'"
    if isinstance(value, bool) or (isinstance(value, str) and value == "never"):
        return
    if isinstance(value, str):
        value_error(name, expected, value)
    type_error(name, expected, value)


def nested_check(classes: tuple[type, ...], expected: str) -> Checker:
    """Nested configs: the right class, and valid themselves (errors name the outer field too)."""

    def check(name: str, value: Any) -> None:
        if not isinstance(value, classes):
            type_error(name, expected, value)
        try:
            value.validate()
        except (TypeError, ValueError) as err:
            raise type(err)(f"Invalid `{name}`: {err}") from err

    return check


def check_no_unknown_keys(cls: type, config_dict: Mapping[str, Any]) -> None:
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(str(key) for key in config_dict if key not in known)
    if unknown:
        raise TypeError(f"{cls.__name__} got unknown keys {unknown}; known keys are {sorted(known)}.")
