"""Greedy search and multinomial sampling: one strategy, as in transformers' ``_sample``.

``init`` prefills the prompt and picks the first token; ``step`` feeds the newest token and picks
the next; ``finish`` trims the buffers. ``init`` and ``step`` share ``_choose_next``, so the first
token goes through exactly the same processors, sampling and stopping as every later one; the token
itself is ``genfn.strategies.token_choice.choose_tokens``, the one choice continuous batching makes too.
"""

from __future__ import annotations

import torch

from genfn.inputs import check_logits_shape
from genfn.processors.context import LogitsContext
from genfn.outputs import GenerateDecoderOnlyOutput
from genfn.state.decode import DecodeOptions, DecodeState
from genfn.processors.guidance import guidance_combine
from genfn.processors.numerics import nonfinite_rows
from genfn.stopping import eos_emitted
from genfn.strategies.base import OUTPUT_KINDS, Strategy
from genfn.strategies.guidance import guidance_init, guidance_step
from genfn.strategies.request import GenerationRequest, StepTrace
from genfn.strategies.token_choice import choose_tokens

__all__ = ["SAMPLE", "init", "step", "finish", "collect", "prefill_positions", "options_for", "model_forward",
           "step_placeholders", "collect_model_outputs", "append_tokens", "newest_input"]


def prefill_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row position ids ``[B, P]`` for a left-padded prompt (padding gets 1, as in transformers)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def model_forward(model, tokens, positions, cache, attention_mask=None, *, attentions=False, hidden_states=False,
                  **kwargs):
    """``(logits, cache, attentions, hidden_states)``; the last two are None unless asked for."""
    if not (attentions or hidden_states):
        logits, cache = model.apply(tokens, positions, cache, attention_mask, **kwargs)
        return logits, cache, None, None
    out = model.apply(tokens, positions, cache, attention_mask, output_attentions=attentions,
                      output_hidden_states=hidden_states, **kwargs)
    return out.logits, out.cache, out.attentions, out.hidden_states


def step_placeholders(attentions, hidden_states):
    """Step-shaped stand-ins (one query position) for the rich outputs of a prefill, so the state
    handed to the first step already has the shapes every step returns."""
    def last_query(tensors, dim):
        if tensors is None:
            return None
        return tuple(t.narrow(dim, t.shape[dim] - 1, 1).clone(memory_format=torch.contiguous_format)
                     for t in tensors)

    return last_query(attentions, 2), last_query(hidden_states, 1)


def collect_model_outputs(state, trace: StepTrace, attentions: bool, hidden_states: bool) -> None:
    """Append the latest step's attentions / hidden states to ``trace`` in transformers' shapes.

    The first call after ``init`` records the prefill's (``[B, H, P, P]``, ``[B, P, hidden]``),
    later ones the step's (``[B, H, 1, P + n]``, ``[B, 1, hidden]``). Attention maps come out of
    the model over all ``attend_len`` cache slots; they are cut to the real key length here.
    """
    if attentions:
        if not trace.attentions:
            maps, kv_len = state.prefill_attentions, state.prefill_attentions[0].shape[2]
        else:
            maps, kv_len = state.attentions, trace.attentions[0][0].shape[-1] + len(trace.attentions)
        trace.attentions.append(tuple(m[..., :kv_len].contiguous() for m in maps))
    if hidden_states:
        first = not trace.hidden_states
        trace.hidden_states.append(state.prefill_hidden_states if first else state.hidden_states)


def options_for(request: GenerationRequest) -> DecodeOptions:
    return DecodeOptions(
        do_sample=bool(request.config.do_sample),
        pad_token_id=request.pad_token_id,
        eos_token_ids=request.eos_token_ids,
        output_scores=request.output_scores,
        output_logits=request.output_logits,
        guidance_scale=None if request.guidance is None else request.guidance.scale,
        check_finite=not bool(request.config.remove_invalid_values),
    )


def _per_row(value, batch: int, device) -> torch.Tensor:
    """An int or a ``[B]`` tensor as a ``[B]`` int64 tensor."""
    return torch.as_tensor(value, dtype=torch.int64, device=device).expand(batch).clone()


def init(model, request: GenerationRequest, cache=None) -> DecodeState:
    """Allocate the buffers, prefill the prompt, and choose the first new token.

    This is also the *prefill* of a request that joins a running batch (see :func:`insert`): its
    state holds the request's rows, ready to be copied into free rows of the batch.
    """
    options = options_for(request)
    input_ids, attention_mask = request.input_ids, request.attention_mask
    max_cache_len, keys = request.max_cache_len, request.keys
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    if cache is None:
        # transformers' default (cache_implementation=None) is the dynamic cache, the eager path.
        cache = model.init_cache(batch, max_cache_len, request.config.cache_implementation or "dynamic",
                                 request.config.cache_config)
    tokens = torch.full((batch, max_cache_len), options.pad_token_id, dtype=torch.int64, device=device)
    tokens[:, :prompt_len] = input_ids
    positions = prefill_positions(attention_mask)
    logits, cache, attentions, hidden_states = model_forward(
        model, input_ids, positions, cache, attention_mask, logits_to_keep=1,
        attentions=request.output_attentions, hidden_states=request.output_hidden_states)
    check_logits_shape(logits, batch, model.vocab_size, request.tokenizer_size)
    step_attentions, step_hidden = step_placeholders(attentions, hidden_states)
    processors = request.processors
    state = DecodeState(
        tokens=tokens,
        cur_len=_per_row(prompt_len, batch, device),
        prompt_len=_per_row(prompt_len, batch, device),
        max_length=_per_row(request.max_length, batch, device),
        positions=positions[:, -1],
        done=torch.zeros(batch, dtype=torch.bool, device=device),
        keys=keys,
        cache=cache,
        scores=None,
        logits=None,
        nonfinite=torch.zeros(batch, dtype=torch.bool, device=device),
        options=options,
        processors=processors,
        processor_state=_init_processor_state(processors, batch, device),
        stop_strings=request.stop_strings,
        attentions=step_attentions,
        hidden_states=step_hidden,
        prefill_attentions=attentions,
        prefill_hidden_states=hidden_states,
        grammar_mask=request.grammar_mask,
    )
    unconditional = None
    if request.guidance is not None:
        guidance, unconditional = guidance_init(model, request.guidance, input_ids, max_cache_len - prompt_len,
                                                request.config.cache_implementation)
        state = state.replace(guidance=guidance)
    return _choose_next(state, logits[:, -1], unconditional)


def _init_processor_state(processors, batch: int, device):
    """The chain's state when it holds a stateful processor (SynthID), else None."""
    if processors is None or not getattr(processors, "stateful", False):
        return None
    return processors.init_state(batch, device)


def newest_input(state: DecodeState) -> torch.Tensor:
    """``[B, 1]`` each row's most recent token (padding for a finished row, as transformers feeds)."""
    return state.tokens.gather(1, (state.cur_len - 1).clamp(min=0).unsqueeze(1))


def step(model, state: DecodeState) -> DecodeState:
    """Feed the newest token of every row and choose the next one (pure; donates ``state``)."""
    newest = newest_input(state)
    positions = state.positions + 1
    want_attentions, want_hidden = state.attentions is not None, state.hidden_states is not None
    logits, cache, attentions, hidden_states = model_forward(
        model, newest, positions.unsqueeze(1), state.cache, attentions=want_attentions, hidden_states=want_hidden)
    state = state.replace(cache=cache, positions=positions, attentions=attentions, hidden_states=hidden_states)
    unconditional = None
    if state.guidance is not None:
        # Classifier-free guidance: the unconditional branch sees the same newest token.
        guidance, unconditional = guidance_step(model, state.guidance, newest)
        state = state.replace(guidance=guidance)
    return _choose_next(state, logits[:, -1], unconditional)


def append_tokens(tokens: torch.Tensor, cur_len: torch.Tensor, new_tokens: torch.Tensor) -> torch.Tensor:
    """Write ``new_tokens [B]`` at each row's column ``cur_len[b]`` of the donated buffer, in place;
    return ``cur_len + 1``. A row already at the buffer's end (it is finished) rewrites its last
    column with padding instead of indexing past the end."""
    batch, width = tokens.shape
    rows = torch.arange(batch, device=tokens.device)
    tokens.index_put_((rows, cur_len.clamp(max=width - 1)), new_tokens)
    return (cur_len + 1).clamp(max=width)


def _choose_next(state: DecodeState, logits: torch.Tensor, unconditional_logits: torch.Tensor | None = None
                 ) -> DecodeState:
    opts = state.options
    ctx = LogitsContext(tokens=state.tokens, cur_len=state.cur_len, prompt_len=state.prompt_len)
    scores = logits
    nonfinite = state.nonfinite
    if opts.check_finite:
        nonfinite = nonfinite | nonfinite_rows(logits)
    if opts.guidance_scale is not None:
        # CFG heads the processor chain, as in transformers.
        scores = guidance_combine(scores, unconditional_logits, opts.guidance_scale)
    keys = state.keys if opts.do_sample else None
    choice = choose_tokens(scores, state.processors, ctx, keys=keys, processor_state=state.processor_state,
                           grammar_mask=state.grammar_mask)
    scores, processor_state, next_tokens = choice.scores, choice.processor_state, choice.tokens
    next_tokens = torch.where(state.done, opts.pad_token_id, next_tokens)
    cur_len = append_tokens(state.tokens, state.cur_len, next_tokens)
    done = state.done | eos_emitted(next_tokens, opts.eos_token_ids) | (cur_len >= state.max_length)
    if state.stop_strings is not None:
        done = done | state.stop_strings(state.tokens, cur_len)
    return state.replace(
        cur_len=cur_len,
        done=done,
        nonfinite=nonfinite,
        processor_state=processor_state,
        scores=scores if opts.output_scores else None,
        logits=logits if opts.output_logits else None,
    )


def collect(state: DecodeState, trace: StepTrace) -> None:
    """Record what the output asked for after a step (the driver calls this between steps)."""
    if state.options.output_scores:
        trace.scores.append(state.scores)
    if state.options.output_logits:
        trace.logits.append(state.logits)
    collect_model_outputs(state, trace, state.attentions is not None, state.hidden_states is not None)


def finish(state: DecodeState, trace: StepTrace, request: GenerationRequest):
    """Trim the buffers into the sequences ``[B, cur_len]`` or a ``GenerateDecoderOnlyOutput``."""
    sequences = state.tokens[:, : int(state.cur_len.max())].clone()
    if not request.config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(trace.scores) if request.output_scores else None,
        logits=tuple(trace.logits) if request.output_logits else None,
        attentions=tuple(trace.attentions) if request.output_attentions else None,
        hidden_states=tuple(trace.hidden_states) if request.output_hidden_states else None,
        cache=state.cache,
    )


# Greedy search and multinomial sampling as a Strategy value (``do_sample`` selects which).
SAMPLE = Strategy(name="sample", init=init, step=step, finish=finish, collect=collect, outputs=OUTPUT_KINDS,
                  whole_loop=True)
