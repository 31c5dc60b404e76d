"""transformers' generation names, answered with genfn's objects: the import shim through which
``benchmarks/upstream_parity.py`` runs transformers' own generation test files against genfn.

``from genfn.bench.upstream_shim import TopKLogitsWarper`` gives genfn's class behind transformers'
calling convention: genfn's processors are called ``processor(logits, ctx)`` (a
:class:`~genfn.processors.context.LogitsContext` over a static token buffer), transformers' tests
call ``processor(input_ids, scores)``. :class:`TransformersCall` is the only adaptation: it builds
the context ``generate`` would build for those ``input_ids`` and forwards everything else (the
public attributes, SynthID's key and g-value methods) to the genfn object untouched. Criteria,
streamers, configs and the guidance processors already take transformers' arguments and are
handed out as they are.

A name genfn does not have resolves to a stand-in that raises :class:`NotInGenfn` when used, so a
test file still imports and only the tests that use the name fail. Names that are not generation
objects (``AutoTokenizer``, ``is_torch_available``, ``set_seed``) are transformers' own: they are
the tests' tools, not what is being compared.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

__all__ = ["NotInGenfn", "TransformersCall", "resolve", "GENFN_HOMES"]

# Where genfn keeps transformers' generation names, searched in this order.
GENFN_HOMES = ("genfn.processors", "genfn.stopping", "genfn.config", "genfn.streamers", "genfn")


class NotInGenfn(NotImplementedError):
    """A transformers generation name genfn does not provide (the reason says why, if genfn knows)."""


class _Missing:
    """Stands in for a name genfn lacks: importing it works, using it raises :class:`NotInGenfn`."""

    def __init__(self, name: str, reason: str):
        self._name, self._reason = name, reason

    def __call__(self, *args, **kwargs):
        raise NotInGenfn(self._reason)

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise NotInGenfn(self._reason)

    def __repr__(self) -> str:
        return f"<not in genfn: {self._name}>"


def _is_genfn_processor(obj: Any) -> bool:
    # Imported here: the shim must import even where a genfn module under test fails to.
    from genfn.processors.external import is_genfn_processor
    return is_genfn_processor(obj)


def _is_genfn_processor_class(cls: type) -> bool:
    from genfn.processors.base import ProcessorBase
    return issubclass(cls, ProcessorBase) or bool(getattr(cls, "genfn_processor", False))


def _unwrap(obj: Any) -> Any:
    return obj.genfn_object if isinstance(obj, TransformersCall) else obj


class TransformersCall:
    """A genfn processor called the way transformers calls one: ``(input_ids, scores) -> scores``.

    ``input_ids`` (``None`` for the warpers that never read it) becomes the token buffer, filled to
    its width in every row; the prompt length is the width of the first call, as ``generate``'s
    first decode step would set it. A stateful processor (SynthID) keeps its state here between
    calls, starting fresh on the first one, as transformers' object keeps it on itself.
    """

    def __init__(self, genfn_object: Any):
        object.__setattr__(self, "genfn_object", genfn_object)
        object.__setattr__(self, "_prompt_len", None)
        object.__setattr__(self, "_state", None)

    def __call__(self, input_ids: torch.Tensor | None, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        from genfn.processors.context import LogitsContext

        batch = scores.shape[0]
        tokens = (torch.zeros((batch, 0), dtype=torch.long, device=scores.device) if input_ids is None
                  else input_ids.to(torch.long))
        width = torch.tensor(tokens.shape[1], dtype=torch.long, device=tokens.device)
        if self._prompt_len is None:
            object.__setattr__(self, "_prompt_len", width)
        ctx = LogitsContext(tokens=tokens, cur_len=width, prompt_len=self._prompt_len)
        processor = self.genfn_object
        if getattr(processor, "stateful", False):
            if self._state is None:
                object.__setattr__(self, "_state", processor.init_state(batch, scores.device))
            out, state = processor.apply(scores, ctx, self._state)
            object.__setattr__(self, "_state", state)
            return out
        return processor(scores, ctx)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.genfn_object, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.genfn_object, name, value)

    def __repr__(self) -> str:
        return f"TransformersCall({self.genfn_object!r})"


class _ProcessorList(list):
    """transformers' ``LogitsProcessorList`` over genfn's :class:`~genfn.processors.ProcessorChain`:
    the chain runs the processors, this only builds it from the list and adapts the call."""

    def __call__(self, input_ids: torch.Tensor | None, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        from genfn.processors.chain import ProcessorChain
        from genfn.processors.external import as_genfn_processor

        chain = ProcessorChain(tuple(as_genfn_processor(_unwrap(p)) for p in self))
        return TransformersCall(chain)(input_ids, scores, **kwargs)


def _adapting(cls: Any) -> Any:
    """``cls``'s constructor, returning a :class:`TransformersCall` around what it builds when that
    is a genfn ``(logits, ctx)`` processor."""
    @functools.wraps(cls, updated=())
    def build(*args, **kwargs):
        obj = cls(*args, **kwargs)
        return TransformersCall(obj) if _is_genfn_processor(obj) else obj
    build.genfn_class = cls
    return build


def _transformers_tool(name: str) -> Any | None:
    """transformers' own ``name`` when it is a test tool (defined outside transformers.generation)."""
    transformers = importlib.import_module("transformers")
    try:
        obj = getattr(transformers, name)
    except AttributeError:
        return None
    module = getattr(obj, "__module__", "") or ""
    return None if module.startswith("transformers.generation") else obj


@functools.cache
def resolve(name: str) -> Any:
    """genfn's object for transformers' generation name ``name`` (see the module docstring)."""
    if name == "LogitsProcessorList":
        return _ProcessorList
    reasons = []
    for home in GENFN_HOMES:
        try:
            obj = getattr(importlib.import_module(home), name)
        except AttributeError as err:
            if "genfn does not run" in str(err) or "belongs to" in str(err):
                reasons.append(str(err))
            continue
        return _adapting(obj) if isinstance(obj, type) and _is_genfn_processor_class(obj) else obj
    tool = _transformers_tool(name)
    if tool is not None:
        return tool
    return _Missing(name, reasons[0] if reasons else f"genfn has no {name}")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return resolve(name)
