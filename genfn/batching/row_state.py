"""What a request carries from one step to the next besides its tokens, in continuous batching.

Two of ``generate``'s settings keep state across steps, and ``generate`` keeps that state in its
decoding state (one row per sequence). Here each request keeps its own one-row copy in its
:class:`RowCarry` (``RequestSettings.carry``), and a step merges the rows it schedules, the way
the engine merges the requests' processor chains (``ProcessorChain.merge_rows``):

* a watermark (SynthID, whose processor keeps state; the green-list one, whose keys and scheme
  are code, not per-row values, so two requests' watermarks need not merge into one): each
  request's chain is split around it (:func:`split_grouped`); the batch chain is the merged
  heads, one :class:`ProcessorRowGroups` (each distinct watermark applied to the rows that use
  it, SynthID with their stacked one-row states), then the merged tails. The step's token choice
  (``choose_tokens``) drives that chain with the stacked state; each row's new state goes back
  to its request's carry once the request got its token;
* classifier-free guidance: the carry holds the request's ``GuidanceSpec``; its unconditional
  branch is a row of the batch (``genfn.batching.guidance_groups``), combined with the request's
  row by ``guidance_combine`` before the processors, where ``generate`` (and transformers) put it.

A carry counts the generated tokens its state has seen, so a request that is preempted and
recomputed resumes its state exactly where it was: the state is the same whatever the batch,
chunking or preemption did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from genfn.batching import guidance_groups
from genfn.processors.base import ProcessorBase
from genfn.processors.chain import ProcessorChain
from genfn.processors.context import LogitsContext
from genfn.processors.synthid import SynthIDTextWatermarkLogitsProcessor
from genfn.processors.watermark import WatermarkLogitsProcessor
from genfn.state.base import pytree_dataclass, static_field, tree_flatten, tree_map
from genfn.strategies.guidance import GuidanceSpec

__all__ = ["RowCarry", "ProcessorRowGroups", "carried_step", "grouped_chain", "keep_carried", "keep_processor_states",
           "merge_request_chains", "split_grouped", "stacked_processor_state"]


@dataclasses.dataclass(eq=False)
class RowCarry:
    """One sequence's state across steps (host-side box; the tensors live on the model's device).

    ``processor_state``: its stateful processor's one-row state, after ``state_tokens`` chosen
    tokens. ``guidance``: its classifier-free guidance spec (the scale; the unconditional branch
    is a request of its own, ``genfn.batching.guidance_groups``).
    """

    processor_state: Any = None
    state_tokens: int = 0
    guidance: GuidanceSpec | None = None


# Processors run on row groups instead of merged into one batch processor.
_WATERMARKS = (SynthIDTextWatermarkLogitsProcessor, WatermarkLogitsProcessor)


def _grouped(p: Any) -> bool:
    return isinstance(p, _WATERMARKS) or bool(getattr(p, "stateful", False))


def grouped_chain(chain: ProcessorChain | None) -> bool:
    """Whether a request's chain holds a processor that runs on row groups (a watermark)."""
    return chain is not None and any(_grouped(p) for p in chain.processors)


def split_grouped(chain: ProcessorChain | None) -> tuple[tuple, Any, tuple]:
    """``(head, watermark or other stateful processor or None, tail)`` of a request's chain (one
    at most: a chain holds one watermark)."""
    if chain is None:
        return (), None, ()
    processors = tuple(chain.processors)
    at = [i for i, p in enumerate(processors) if _grouped(p)]
    if not at:
        return processors, None, ()
    if len(at) > 1:
        raise ValueError("a request's processor chain holds more than one watermark or stateful processor")
    return processors[:at[0]], processors[at[0]], processors[at[0] + 1:]


def _same_function(a: Any, b: Any) -> bool:
    """Whether two processors compute the same thing (same kind, statics and tensor values)."""
    if a is b:
        return True
    leaves_a, tree_a = tree_flatten(a)
    leaves_b, tree_b = tree_flatten(b)
    if tree_a != tree_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                    and x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu())):
                return False
        elif x != y:
            return False
    return True


@pytree_dataclass
class ProcessorRowGroups(ProcessorBase):
    """Processors on row groups of a batch: ``processors[g]`` runs on rows ``rows[g]``, a stateful
    one with state ``state[g]`` (those rows' states stacked, in ``rows[g]``'s order; ``None`` for a
    stateless one); other rows keep their logits. Build with :func:`merge_request_chains`."""

    stateful = True
    compile_safe = False  # row gathers by host-built indices (run_batch is eager around the forward)

    processors: tuple
    index: tuple  # per group, [n_g] int64 row indices on the device
    rows: tuple = static_field(())  # per group, the same rows as host ints

    def init_state(self, batch_size: int, device: Any = None) -> tuple:
        return tuple(p.init_state(len(rows), device) if getattr(p, "stateful", False) else None
                     for p, rows in zip(self.processors, self.rows))

    def apply(self, logits: torch.Tensor, ctx: LogitsContext, state: tuple) -> tuple[torch.Tensor, tuple]:
        new_state = []
        for p, index, group_state in zip(self.processors, self.index, state):
            index = index.to(logits.device)
            sub = LogitsContext(tokens=ctx.tokens.index_select(0, index),
                                cur_len=ctx.row_cur_len().index_select(0, index),
                                prompt_len=ctx.row_prompt_len().index_select(0, index))
            if getattr(p, "stateful", False):
                out, group_state = p.apply(logits.index_select(0, index), sub, group_state)
            else:
                out = p(logits.index_select(0, index), sub)
            logits = logits.index_copy(0, index, out.to(logits.dtype))
            new_state.append(group_state)
        return logits, tuple(new_state)

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        raise TypeError("ProcessorRowGroups is stateful: use `init_state` and `apply`")


def merge_request_chains(chains: Sequence[ProcessorChain | None], samples: Sequence[bool], num_rows: int,
                         device: Any = None) -> ProcessorChain:
    """The batch chain of rows whose request chains are ``chains`` (padded to ``num_rows``).

    Without a watermark it is ``ProcessorChain.merge_rows`` of the rows. With one, each row's
    chain is split around it: merged heads, then one :class:`ProcessorRowGroups` over the rows that
    ``samples`` (the others' scores are not used, and their state must not move), then merged
    tails."""
    empty = ProcessorChain(())
    padding = [empty] * (num_rows - len(chains))
    if not any(grouped_chain(c) for c in chains):
        return ProcessorChain.merge_rows([c if c is not None else empty for c in chains] + padding, device=device)
    heads, tails, groups = [], [], []  # groups: [processor, [rows]]
    for row, (chain, sampled) in enumerate(zip(chains, samples)):
        head, stateful, tail = split_grouped(chain)
        heads.append(ProcessorChain(head))
        tails.append(ProcessorChain(tail))
        if stateful is None or not sampled:
            continue
        group = next((g for g in groups if _same_function(g[0], stateful)), None)
        if group is None:
            groups.append([stateful, [row]])
        else:
            group[1].append(row)
    processors = []
    for part in (heads, tails):
        if any(len(c) for c in part):
            processors.append(ProcessorChain.merge_rows(part + padding, device=device).processors)
        else:
            processors.append(())
    grouped = ProcessorRowGroups(tuple(g[0] for g in groups),
                                tuple(torch.tensor(g[1], dtype=torch.int64, device=device) for g in groups),
                                tuple(tuple(g[1]) for g in groups))
    return ProcessorChain((*processors[0], grouped, *processors[1]))


def _groups(chain: ProcessorChain | None) -> tuple[int, ProcessorRowGroups] | None:
    if chain is None:
        return None
    return next(((i, p) for i, p in enumerate(chain.processors) if isinstance(p, ProcessorRowGroups)), None)


def _concat(states: list) -> Any:
    return tree_map(lambda *rows: torch.cat(rows, dim=0), states[0], *states[1:])


def stacked_processor_state(chain: ProcessorChain | None, carries: Sequence[RowCarry | None],
                            generated: Sequence[int], device: Any = None) -> tuple | None:
    """The batch chain's state for this step from the rows' carries (``None``: no stateful
    processor). ``carries[row]``, ``generated[row]``: each batch row's carry and the number of
    tokens its request generated so far (what its state must have seen)."""
    found = _groups(chain)
    if found is None:
        return None
    at, grouped = found
    group_states = []
    for p, rows in zip(grouped.processors, grouped.rows):
        if not getattr(p, "stateful", False):
            group_states.append(None)
            continue
        states = []
        for row in rows:
            carry = carries[row]
            if carry.processor_state is None:
                carry.processor_state, carry.state_tokens = p.init_state(1, device), 0
            if carry.state_tokens != generated[row]:
                raise RuntimeError(f"a request's processor state saw {carry.state_tokens} tokens but the request "
                                   f"generated {generated[row]}")
            states.append(carry.processor_state)
        group_states.append(_concat(states))
    state = [None] * len(chain.processors)
    state[at] = tuple(group_states)
    return tuple(state)


def keep_processor_states(chain: ProcessorChain | None, state: tuple | None, carries: Sequence[RowCarry | None],
                          chosen: Sequence[bool]) -> None:
    """Store each grouped row's new state in its carry, for the rows whose token was ``chosen``
    (kept: a row whose request failed this step leaves its carry as it was)."""
    found = _groups(chain)
    if found is None or state is None:
        return
    at, grouped = found
    for p, group_state, rows in zip(grouped.processors, state[at], grouped.rows):
        if not getattr(p, "stateful", False):
            continue
        for i, row in enumerate(rows):
            if chosen[row]:
                carry = carries[row]
                carry.processor_state = tree_map(lambda x, i=i: x[i:i + 1], group_state)
                carry.state_tokens += 1


def carried_step(requests: Mapping[Hashable, Any], batch, settings_of, chain: ProcessorChain | None,
                 logits: torch.Tensor, *, device: Any = None) -> tuple[torch.Tensor, tuple | None]:
    """The engine step's hook before its token choice: ``(logits, processor_state)``, the logits
    with the guided rows combined (``guidance_groups.combine``) and the chain's stacked state
    (:func:`stacked_processor_state`; ``None`` without a stateful processor)."""
    logits = guidance_groups.combine(requests, batch, logits, settings_of)
    if _groups(chain) is None:
        return logits, None
    carries = [settings_of(requests[c.request_id]).carry for c in batch.chunks]
    generated = [len(requests[c.request_id].generated_ids) for c in batch.chunks]
    return logits, stacked_processor_state(chain, carries, generated, device)


def keep_carried(requests: Mapping[Hashable, Any], batch, settings_of, chain: ProcessorChain | None,
                 state: tuple | None, new_tokens: Mapping[Hashable, int]) -> None:
    """The engine step's hook after its token choice: each row that got a token keeps its new
    processor state (:func:`keep_processor_states`)."""
    if state is None:
        return
    carries = [settings_of(requests[c.request_id]).carry for c in batch.chunks]
    keep_processor_states(chain, state, carries, [c.request_id in new_tokens for c in batch.chunks])
