"""Generation output types that behave like transformers' ``ModelOutput``."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["ModelOutput", "GenerateDecoderOnlyOutput", "GenerateEncoderDecoderOutput",
           "GenerateBeamDecoderOnlyOutput", "GenerateBeamEncoderDecoderOutput"]


class ModelOutput(OrderedDict):
    """A dataclass that is also an ordered mapping of its non-None fields.

    Attribute access, key access (``out["sequences"]``), integer indexing and ``to_tuple()``
    all see the same values, in field order, skipping fields that are None: exactly how
    transformers' outputs behave, so code written against them keeps working.
    """

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                super().__setitem__(f.name, value)

    def __getitem__(self, key):
        if isinstance(key, str):
            return dict(self.items())[key]
        return self.to_tuple()[key]

    def __setattr__(self, name, value):
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __reduce__(self):
        return (self.__class__, tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self[k] for k in self.keys())

    @property
    def past_key_values(self):
        """The returned cache under its transformers 4.x name (transformers 5 calls the field ``cache``)."""
        return getattr(self, "cache", None)


def _output(cls):
    cls = dataclasses.dataclass(eq=False, repr=True)(cls)
    return cls


@_output
class GenerateDecoderOnlyOutput(ModelOutput):
    sequences: torch.Tensor = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[tuple[torch.Tensor, ...], ...] | None = None
    hidden_states: tuple[tuple[torch.Tensor, ...], ...] | None = None
    cache: Any = None


@_output
class GenerateEncoderDecoderOutput(ModelOutput):
    sequences: torch.Tensor = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    encoder_attentions: tuple[torch.Tensor, ...] | None = None
    encoder_hidden_states: tuple[torch.Tensor, ...] | None = None
    decoder_attentions: tuple[tuple[torch.Tensor, ...], ...] | None = None
    cross_attentions: tuple[tuple[torch.Tensor, ...], ...] | None = None
    decoder_hidden_states: tuple[tuple[torch.Tensor, ...], ...] | None = None
    cache: Any = None


@_output
class GenerateBeamDecoderOnlyOutput(ModelOutput):
    sequences: torch.Tensor = None
    sequences_scores: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    beam_indices: torch.Tensor | None = None
    attentions: tuple[tuple[torch.Tensor, ...], ...] | None = None
    hidden_states: tuple[tuple[torch.Tensor, ...], ...] | None = None
    cache: Any = None


@_output
class GenerateBeamEncoderDecoderOutput(ModelOutput):
    sequences: torch.Tensor = None
    sequences_scores: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    beam_indices: torch.Tensor | None = None
    encoder_attentions: tuple[torch.Tensor, ...] | None = None
    encoder_hidden_states: tuple[torch.Tensor, ...] | None = None
    decoder_attentions: tuple[tuple[torch.Tensor, ...], ...] | None = None
    cross_attentions: tuple[tuple[torch.Tensor, ...], ...] | None = None
    decoder_hidden_states: tuple[tuple[torch.Tensor, ...], ...] | None = None
    cache: Any = None
