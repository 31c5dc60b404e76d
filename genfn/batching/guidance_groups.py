"""Classifier-free guidance in continuous batching: the unconditional branch is a row of the batch.

A guided request (``guidance_scale``) enters the scheduler with a partner, its *unconditional
request* ``(id, "unconditional")``, whose tokens are ``generate``'s unconditional input
(``genfn.strategies.guidance``): the negative prompt (``negative_prompt_ids``), or the prompt's
last token, then every token the guided request generated. The two are a ``RequestGroup``
(``genfn.batching.groups``): each computes its prompt (chunked like any prompt), then both compute
their last token in the same forward, or neither does. So the unconditional branch's keys and
values live in blocks of the paged cache, counted in its budget and shared through its prefix
cache, and preempting either sends both back, to be recomputed together.

In a step, :func:`combine` replaces the guided row's logits by ``guidance_combine`` of them and
its partner's row, before the processors, where ``generate`` combines them; :func:`follow` then
gives the partner the guided row's token; :func:`drop_partners` ends the partners of the requests
that ended. The partner never samples for itself and never fails on its own logits
(``check_finite`` off): what it computes only shapes its request's distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from genfn.batching import groups as G
from genfn.batching import scheduling as S
from genfn.batching.requests import RequestState, make_request
from genfn.processors.guidance import guidance_combine

__all__ = ["PARTNER_KEY", "add_request", "combine", "drop_partners", "follow", "partner_id", "split_partner",
           "unconditional_ids", "with_partner"]

# The key of a guided request's partner (a RequestState) in its settings, until it is queued.
PARTNER_KEY = "genfn.unconditional"


def partner_id(request_id: Hashable) -> Hashable:
    """The id of a guided request's unconditional request."""
    return (request_id, "unconditional")


def unconditional_ids(spec, prompt_ids) -> tuple[int, ...]:
    """``generate``'s unconditional input for one prompt row: the negative prompt, else the prompt's
    last token. A ValueError for a left-padded negative prompt: ``generate`` counts its padded
    slots as positions, which a request's own tokens cannot."""
    if spec.input_ids is None:
        return tuple(prompt_ids[-1:])
    if spec.attention_mask is not None and not bool(spec.attention_mask[0].all()):
        raise ValueError("negative_prompt_attention_mask with padding is not supported in continuous batching; pass "
                         "the negative prompt's tokens alone (negative_prompt_ids), or run it with genfn.generate")
    return tuple(spec.input_ids[0].tolist())


def with_partner(request: RequestState, tokens, settings: Mapping) -> RequestState:
    """``request`` carrying its unconditional request (``tokens``: its unconditional input;
    ``settings``: the partner's), which :func:`add_request` queues beside it."""
    partner = make_request(partner_id(request.request_id), tokens, None, None, settings)
    return request.replace(settings=MappingProxyType({**request.settings, PARTNER_KEY: partner}))


def split_partner(request: RequestState) -> tuple[RequestState, RequestState | None]:
    """``(request without its partner, the partner or None)``."""
    if not isinstance(request, RequestState) or PARTNER_KEY not in request.settings:
        return request, None  # (scheduling.add_request refuses what is not a RequestState)
    settings = dict(request.settings)
    partner = settings.pop(PARTNER_KEY)
    return request.replace(settings=MappingProxyType(settings)), partner


def add_request(state: S.SchedulerState, request: RequestState) -> S.SchedulerState:
    """Queue ``request`` (``scheduling.add_request``); a guided one with its partner right behind
    it, the two a group."""
    request, partner = split_partner(request)
    state = S.add_request(state, request)
    if partner is None:
        return state
    state = S.add_request(state, partner)
    group = G.RequestGroup((request.request_id, partner.request_id))
    return state.replace(groups=MappingProxyType({**state.groups, request.request_id: group}))


def _guidance(request: RequestState, settings_of: Callable) -> Any:
    carry = settings_of(request).carry
    return None if carry is None else carry.guidance


def combine(requests: Mapping[Hashable, RequestState], batch: S.ScheduledBatch, logits: torch.Tensor,
            settings_of: Callable) -> torch.Tensor:
    """``logits [R, V]`` with each guided sampling row replaced by ``guidance_combine`` of its
    logits and its partner's row in the same batch."""
    rows = {c.request_id: i for i, c in enumerate(batch.chunks) if c.samples}
    out = logits
    for request_id, row in rows.items():
        spec = _guidance(requests[request_id], settings_of)
        if spec is None:
            continue
        partner = rows.get(partner_id(request_id))
        if partner is None:
            raise RuntimeError(f"guided request {request_id!r} sampled without its unconditional request: queue "
                               f"guided requests with genfn.batching.guidance_groups.add_request")
        guided = guidance_combine(logits[row:row + 1], logits[partner:partner + 1], spec.scale)
        if out is logits:
            out = logits.clone()
        out[row] = guided[0].to(out.dtype)
    return out


def follow(requests: Mapping[Hashable, RequestState], batch: S.ScheduledBatch, new_tokens: dict,
           logprobs: dict, settings_of: Callable) -> None:
    """Give each partner in ``batch`` its guided request's new token (in place)."""
    for chunk in batch.chunks:
        request_id = chunk.request_id
        if chunk.samples and request_id in new_tokens and _guidance(requests[request_id], settings_of) is not None:
            new_tokens[partner_id(request_id)] = new_tokens[request_id]
            logprobs[partner_id(request_id)] = 0.0


def drop_partners(state: S.SchedulerState, ended) -> S.SchedulerState:
    """End the partners of the ``ended`` requests (a request's group ends with it)."""
    for request in ended:
        if partner_id(request.request_id) in state.requests:
            state, _ = S.finish(state, partner_id(request.request_id))
    return state
