"""Watermarking configs: green-list (Kirchenbauer et al.) and SynthID Text, with transformers' fields."""

from __future__ import annotations

import abc
import copy
import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .checks import Interval, check_bool, check_no_unknown_keys, choice_check, int_check, is_int, is_sequence
from .checks import real_check, type_error, value_error

__all__ = [
    "BaseWatermarkingConfig",
    "WatermarkingConfig",
    "SynthIDTextWatermarkingConfig",
    "watermarking_config_from_dict",
]


class BaseWatermarkingConfig(abc.ABC):
    """Shared (de)serialization of the watermarking configs (subclasses are dataclasses).

    Both configs validate on construction: a watermark that silently does nothing, or crashes in
    the middle of generation, is worse than an error at the line that built it.
    """

    @abc.abstractmethod
    def validate(self) -> None:
        """Raise ValueError naming the field when a setting is out of range."""

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any], **kwargs: Any) -> BaseWatermarkingConfig:
        """Build from a dict; ``kwargs`` override known keys (unknown kwargs are ignored, as in transformers)."""
        check_no_unknown_keys(cls, config_dict)
        config = cls(**config_dict)
        config.update(**kwargs)
        return config

    def to_dict(self) -> dict[str, Any]:
        return {field.name: copy.deepcopy(getattr(self, field.name)) for field in dataclasses.fields(self)}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike) -> None:
        with open(json_file_path, "w", encoding="utf-8") as writer:
            writer.write(self.to_json_string())

    def update(self, **kwargs: Any) -> dict[str, Any]:
        """Set the known keys, validate, and return the unknown ones."""
        known = {field.name for field in dataclasses.fields(self)}
        for key, value in kwargs.items():
            if key in known:
                setattr(self, key, value)
        self.validate()
        return {key: value for key, value in kwargs.items() if key not in known}

    def __iter__(self):
        yield from self.to_dict().items()


@dataclass
class WatermarkingConfig(BaseWatermarkingConfig):
    """Green-list watermarking (Kirchenbauer et al., 2023): bias a pseudo-random "green" token subset.

    ``greenlist_ratio``: share of the vocabulary that is green. ``bias``: added to green logits.
    ``hashing_key``: seeds the green-list hash. ``seeding_scheme``: ``"lefthash"`` (seed from the
    previous tokens) or ``"selfhash"`` (also from the candidate token). ``context_width``: how many
    previous tokens seed the hash.
    """

    greenlist_ratio: float = 0.25
    bias: float = 2.0
    hashing_key: int = 15485863
    seeding_scheme: str = "lefthash"
    context_width: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        real_check(Interval(0.0, 1.0))("greenlist_ratio", self.greenlist_ratio)
        real_check()("bias", self.bias)
        int_check()("hashing_key", self.hashing_key)
        choice_check(("lefthash", "selfhash"))("seeding_scheme", self.seeding_scheme)
        int_check(minimum=1)("context_width", self.context_width)


@dataclass
class SynthIDTextWatermarkingConfig(BaseWatermarkingConfig):
    """SynthID Text watermarking (Dathathri et al., Nature 2024): tournament sampling keyed by n-grams.

    ``ngram_len``: n-gram length used for keying. ``keys``: one watermarking key per tournament
    layer. ``context_history_size``: how many seen contexts are remembered. ``sampling_table_seed``
    and ``sampling_table_size`` (at most 2**24): the pseudo-random sampling table.
    ``skip_first_ngram_calls``: leave the first n-gram steps unwatermarked. ``debug_mode``: make
    the logits uniform before watermarking, to test the implementation.
    """

    ngram_len: int
    keys: list[int]
    context_history_size: int = 1024
    sampling_table_seed: int = 0
    sampling_table_size: int = 2**16
    skip_first_ngram_calls: bool = False
    debug_mode: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        int_check(minimum=1)("ngram_len", self.ngram_len)
        if not is_sequence(self.keys) or not all(is_int(key) for key in self.keys):
            type_error("keys", "a non-empty list of ints", self.keys)
        if len(self.keys) == 0:
            value_error("keys", "a non-empty list of ints", self.keys)
        int_check(minimum=1)("context_history_size", self.context_history_size)
        int_check()("sampling_table_seed", self.sampling_table_seed)
        int_check(minimum=1, maximum=2**24)("sampling_table_size", self.sampling_table_size)
        check_bool("skip_first_ngram_calls", self.skip_first_ngram_calls)
        check_bool("debug_mode", self.debug_mode)


def watermarking_config_from_dict(config_dict: Mapping[str, Any]) -> BaseWatermarkingConfig:
    """A watermarking config from its JSON dict, picking the class from the keys.

    transformers always builds a ``WatermarkingConfig`` here, so a saved SynthID config cannot be
    loaded back there; dispatching on SynthID's own keys fixes that.
    """
    if "ngram_len" in config_dict or "keys" in config_dict:
        return SynthIDTextWatermarkingConfig.from_dict(config_dict)
    return WatermarkingConfig.from_dict(config_dict)
