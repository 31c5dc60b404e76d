"""The ``Strategy`` protocol: a decoding strategy is a value, a record of pure functions.

The driver needs nothing else to run a strategy, eagerly or compiled, with streaming, stopping
criteria, ``max_time`` and per-step outputs::

    init(model, request)        -> state    # prefill; allocates the static buffers; first token
    step(model, state)          -> state    # one decode step: pure, compiled by the driver
    finish(state, trace, request) -> output # trims the buffers into the output types

``init`` receives the ``genfn.Model`` (it allocates caches); ``step`` receives a
``genfn.models.functional.FunctionalModel`` — the same kind of value eagerly and compiled.
``request`` is the ``GenerationRequest`` ``generate`` resolved (inputs, lengths, processors, keys).

What the driver reads from a state, between steps (one host sync per step):

* ``state.done`` — ``[B]`` (or ``[]``) bool; the loop ends when every row is done;
* ``state.tokens [B, N]`` and ``state.cur_len [B]`` — streamed and shown to user stopping
  criteria when the strategy ``streams`` (a step may append any number of tokens to a row: the
  driver streams the difference);
* ``state.nonfinite [B]`` (optional) — rows whose logits held NaN/inf: the driver raises;
* ``state.scores`` (optional) — passed to user stopping criteria;
* ``state.cache`` — when it supports ``with_span``, the driver limits attention to the filled
  slots before every step (one compiled step serves every length).

The declared capabilities tell ``generate`` what it may combine the strategy with; asking for
something a strategy does not declare is a ``ValueError`` naming both.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["Strategy", "OUTPUT_KINDS"]

OUTPUT_KINDS = frozenset({"scores", "logits", "attentions", "hidden_states"})


def _no_collect(state: Any, trace: Any) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A decoding strategy: three pure functions and what they can do.

    ``collect(state, trace)`` records per-step outputs into the ``StepTrace`` between steps.
    ``tokens_per_step``: the most tokens one step appends to a row (sizes the attention span).
    ``compiles``: ``step`` traces under ``torch.compile(fullgraph=True)``.
    ``streams``: states expose ``tokens``/``cur_len``, so streamers and user stopping criteria work.
    ``outputs``: which per-step outputs (``OUTPUT_KINDS``) ``finish`` can return.
    ``whole_loop``: the step may run inside one ``while_loop`` graph (``compile_loop=True``).
    ``pick_step(state) -> step``: when set, the driver asks it between steps (on the host) which
    pure step runs next, e.g. a speculative round whose rows have no draft runs a one-token
    forward. Every step it returns takes and returns states of one layout; each is compiled once.
    """

    name: str
    init: Callable[[Any, Any], Any]
    step: Callable[[Any, Any], Any]
    finish: Callable[[Any, Any, Any], Any]
    collect: Callable[[Any, Any], None] = _no_collect
    tokens_per_step: int = 1
    compiles: bool = True
    streams: bool = True
    outputs: frozenset = frozenset()
    whole_loop: bool = False
    pick_step: Callable[[Any], Callable[[Any, Any], Any]] | None = None

    def __post_init__(self):
        for name in ("init", "step", "finish", "collect"):
            if not callable(getattr(self, name)):
                raise TypeError(f"Strategy.{name} must be callable, got {type(getattr(self, name)).__name__}")
        if self.pick_step is not None and not callable(self.pick_step):
            raise TypeError(f"Strategy.pick_step must be None or callable, got {type(self.pick_step).__name__}")
        if not isinstance(self.tokens_per_step, int) or self.tokens_per_step < 1:
            raise ValueError(f"Strategy.tokens_per_step must be a positive int, got {self.tokens_per_step!r}")
        unknown = set(self.outputs) - OUTPUT_KINDS
        if unknown:
            raise ValueError(f"Strategy.outputs has unknown kinds {sorted(unknown)}; allowed: {sorted(OUTPUT_KINDS)}")
