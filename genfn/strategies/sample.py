"""Greedy search and multinomial sampling: one strategy, as in transformers' ``_sample``.

``init`` prefills the prompt and picks the first token; ``step`` feeds the newest token and picks
the next; ``finish`` trims the buffers. ``init`` and ``step`` share ``_choose_next``, so the first
token goes through exactly the same processors, sampling and stopping as every later one.
"""

from __future__ import annotations

import torch

from genfn import random as grandom
from genfn.processors.context import LogitsContext
from genfn.outputs import GenerateDecoderOnlyOutput
from genfn.state.decode import DecodeOptions, DecodeState
from genfn.stopping import eos_emitted, max_length_reached
from genfn.strategies.request import GenerationRequest, StepTrace

__all__ = ["init", "step", "finish", "collect", "newest_tokens", "prefill_positions", "options_for"]


def prefill_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row position ids ``[B, P]`` for a left-padded prompt (padding gets 1, as in transformers)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def options_for(request: GenerationRequest) -> DecodeOptions:
    return DecodeOptions(
        do_sample=bool(request.config.do_sample),
        pad_token_id=request.pad_token_id,
        eos_token_ids=request.eos_token_ids,
        processors=request.processors,
        processors_key=request.processors_key,
        output_scores=request.output_scores,
        output_logits=request.output_logits,
    )


def init(model, request: GenerationRequest, cache=None) -> DecodeState:
    """Allocate the buffers, prefill the prompt, and choose the first new token."""
    options = options_for(request)
    input_ids, attention_mask = request.input_ids, request.attention_mask
    max_length, max_cache_len, keys = request.max_length, request.max_cache_len, request.keys
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    if cache is None:
        cache = model.init_cache(batch, max_cache_len)
    tokens = torch.full((batch, max_cache_len), options.pad_token_id, dtype=torch.int64, device=device)
    tokens[:, :prompt_len] = input_ids
    positions = prefill_positions(attention_mask)
    logits, cache = model.apply(input_ids, positions, cache, attention_mask, logits_to_keep=1)
    state = DecodeState(
        tokens=tokens,
        cur_len=torch.tensor(prompt_len, dtype=torch.int64, device=device),
        prompt_len=torch.tensor(prompt_len, dtype=torch.int64, device=device),
        max_length=torch.tensor(max_length, dtype=torch.int64, device=device),
        positions=positions[:, -1],
        done=torch.zeros(batch, dtype=torch.bool, device=device),
        keys=keys,
        cache=cache,
        scores=None,
        logits=None,
        options=options,
    )
    return _choose_next(state, logits[:, -1])


def step(model, state: DecodeState) -> DecodeState:
    """Feed the newest token of every row and choose the next one (pure; donates ``state``)."""
    batch = state.batch_size
    newest = state.tokens.gather(1, (state.cur_len - 1).reshape(1, 1).expand(batch, 1))
    positions = state.positions + 1
    logits, cache = model.apply(newest, positions.unsqueeze(1), state.cache, attend_len=state.options.attend_len)
    return _choose_next(state.replace(cache=cache, positions=positions), logits[:, -1])


def _choose_next(state: DecodeState, logits: torch.Tensor) -> DecodeState:
    opts = state.options
    ctx = LogitsContext(tokens=state.tokens, cur_len=state.cur_len, prompt_len=state.prompt_len)
    scores = logits if opts.processors is None else opts.processors(logits, ctx)
    if opts.do_sample:
        # The noise counter is the number of tokens this row generated so far: independent of
        # how much left padding the batch gave the row.
        counter = (state.cur_len - state.prompt_len).expand(state.batch_size)
        noise = grandom.gumbel(state.keys, counter, scores.shape[-1])
        next_tokens = torch.argmax(scores + noise, dim=-1)
    else:
        next_tokens = torch.argmax(scores, dim=-1)
    next_tokens = torch.where(state.done, opts.pad_token_id, next_tokens)
    state.tokens.index_copy_(1, state.cur_len.reshape(1), next_tokens.unsqueeze(1))
    cur_len = state.cur_len + 1
    done = state.done | eos_emitted(next_tokens, opts.eos_token_ids)
    done = done | max_length_reached(cur_len, state.max_length, state.batch_size)
    return state.replace(
        cur_len=cur_len,
        done=done,
        scores=scores if opts.output_scores else None,
        logits=logits if opts.output_logits else None,
    )


def collect(state: DecodeState, trace: StepTrace) -> None:
    """Record what the output asked for after a step (the driver calls this between steps)."""
    if state.options.output_scores:
        trace.scores.append(state.scores)
    if state.options.output_logits:
        trace.logits.append(state.logits)


def newest_tokens(state: DecodeState, cur_len: int) -> torch.Tensor:
    """``[B]`` the tokens chosen by the latest step, for streaming (``cur_len`` known on the host)."""
    return state.tokens[:, cur_len - 1]


def finish(state: DecodeState, trace: StepTrace, request: GenerationRequest):
    """Trim the buffers into the sequences ``[B, cur_len]`` or a ``GenerateDecoderOnlyOutput``."""
    sequences = state.tokens[:, : int(state.cur_len)].clone()
    if not request.config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(trace.scores) if request.output_scores else None,
        logits=tuple(trace.logits) if request.output_logits else None,
    )
