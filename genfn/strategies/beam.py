"""Beam search and beam sampling, as in transformers' vectorized ``_beam_search``.

``init`` prefills the ``B * K`` beam-expanded prompt rows (as transformers does, so the numbers
are the same) and takes the first beam step on the prefill logits; ``step`` feeds every beam's
newest token and takes the next beam step; ``finish`` returns the best ``num_return_sequences``
hypotheses per prompt. A beam step, all on static shapes:

1. log-softmax the logits, run the logits processors on them, add each beam's running score:
   ``K * V`` candidates per prompt;
2. keep ``K2 = max(2, 1 + num_eos) * K`` of them: the top ``K2`` (beam search), or ``K2`` drawn
   without replacement from ``softmax`` of the accumulated scores with keyed Gumbel-top-k and
   then sorted by score (beam sampling: the same distribution as transformers'
   ``torch.multinomial``, without its host sync);
3. candidates that emit EOS or reach ``max_length`` are finished: the best ``K`` unfinished ones
   become the running beams; finished ones among the top ``K`` candidates enter the ``K`` best
   finished hypotheses with score ``sum_logprobs / generated_len ** length_penalty``;
4. the KV cache rows are reordered to follow the beams (``cache.reorder``, in place; continuous
   batching forks the beams' block tables instead: ``select_beams`` is steps 1-3 and 5);
5. the search is done when no running beam can beat the finished ones (``early_stopping``
   False: at the current length; ``"never"``: at ``max_length`` when ``length_penalty > 0``),
   when every prompt has ``K`` finished hypotheses and ``early_stopping is True``, or when every
   candidate hit a stopping criterion.
"""

from __future__ import annotations

import torch

from genfn import random as grandom
from genfn.inputs import check_logits_shape
from genfn.outputs import GenerateBeamDecoderOnlyOutput
from genfn.processors.context import LogitsContext
from genfn.processors.numerics import nonfinite_rows
from genfn.processors.grammar import apply_token_bitmask
from genfn.strategies.base import OUTPUT_KINDS, Strategy
from genfn.state.beam import BeamOptions, BeamState
from genfn.strategies.request import GenerationRequest, StepTrace
from genfn.strategies.sample import collect_model_outputs, model_forward, prefill_positions, step_placeholders

__all__ = ["BEAM", "collect", "finish", "init", "initial_state", "options_for", "select_beams", "step"]

_NEG = -1.0e9  # transformers' "never choose this" score


def _fill_token_id(request: GenerationRequest) -> int:
    # transformers: `pad_token_id or eos_token_id[0] if eos_token_id is not None else -1`, so a pad
    # id of 0 falls back to the first EOS id, and no EOS at all fills with -1.
    if not request.eos_token_ids:
        return -1
    return request.pad_token_id if request.pad_token_id else request.eos_token_ids[0]


def options_for(request: GenerationRequest) -> BeamOptions:
    config = request.config
    num_beams = int(config.num_beams)
    if request.input_ids.shape[0] % num_beams:
        raise ValueError(f"beam search expects the prompt rows expanded {num_beams} times (repeat_interleave); got "
                         f"{request.input_ids.shape[0]} rows")
    early_stopping = config.early_stopping if config.early_stopping is not None else False
    length_penalty = float(config.length_penalty if config.length_penalty is not None else 1.0)
    if request.processors is not None and getattr(request.processors, "stateful", False):
        raise ValueError("stateful logits processors (SynthID watermarking) are not supported with beam search")
    return BeamOptions(
        num_beams=num_beams,
        num_return_sequences=int(config.num_return_sequences or 1),
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        do_sample=bool(config.do_sample),
        eos_token_ids=tuple(request.eos_token_ids),
        pad_token_id=request.pad_token_id,
        fill_token_id=_fill_token_id(request),
        output_scores=request.output_scores,
        output_logits=request.output_logits,
        output_attentions=request.output_attentions,
        output_hidden_states=request.output_hidden_states,
        check_finite=not bool(config.remove_invalid_values),
    )


def init(model, request: GenerationRequest, cache=None) -> BeamState:
    """Allocate the beam buffers, prefill the ``B * K`` expanded prompt rows, take the first beam step.

    ``request.input_ids`` / ``attention_mask`` are ``[B * K, P]``: each prompt repeated ``K``
    times consecutively (``generate`` expands them, as transformers' ``_expand_inputs_for_generation``).
    ``request.keys`` (beam sampling) is ``[B, 2]``, one key per prompt.
    """
    opts = options_for(request)
    input_ids, attention_mask = request.input_ids, request.attention_mask
    rows = input_ids.shape[0]
    if cache is None:
        # As greedy/sampling: transformers' default (cache_implementation=None) is the dynamic cache.
        cache = model.init_cache(rows, request.max_cache_len, request.config.cache_implementation or "dynamic",
                                 request.config.cache_config)
    positions = prefill_positions(attention_mask)
    logits, cache, attentions, hidden_states = model_forward(
        model, input_ids, positions, cache, attention_mask, logits_to_keep=1,
        attentions=opts.output_attentions, hidden_states=opts.output_hidden_states)
    check_logits_shape(logits, rows, model.vocab_size, request.tokenizer_size)
    step_attentions, step_hidden = step_placeholders(attentions, hidden_states)
    state = initial_state(request, opts).replace(
        cache=cache, positions=positions[:, -1], attentions=step_attentions, hidden_states=step_hidden,
        prefill_attentions=attentions, prefill_hidden_states=hidden_states)
    return _beam_step(state, logits[:, -1])


def initial_state(request: GenerationRequest, opts: BeamOptions | None = None) -> BeamState:
    """The beam buffers before the first beam step, without a cache (``init`` adds the prefilled
    one; continuous batching keeps a group's beams in its paged cache): ``B`` prompts, the first
    beam of each alive, ``N = request.max_cache_len`` token columns."""
    opts = options_for(request) if opts is None else opts
    input_ids = request.input_ids
    rows, prompt_len = input_ids.shape
    num_beams = opts.num_beams
    batch = rows // num_beams
    width = request.max_cache_len
    device = input_ids.device
    if opts.do_sample and (request.keys is None or request.keys.shape != (batch, 2)):
        raise ValueError(f"beam sampling needs one key per prompt: keys of shape [{batch}, 2]")
    running_sequences = torch.full((batch, num_beams, width), opts.fill_token_id, dtype=torch.int64, device=device)
    running_sequences[:, :, :prompt_len] = input_ids.view(batch, num_beams, prompt_len)
    # Only the first beam starts alive, so the first step does not pick the same token K times.
    running_scores = torch.zeros(batch, num_beams, dtype=torch.float32, device=device)
    running_scores[:, 1:] = _NEG
    beam_indices = torch.full((batch, num_beams, width), -1, dtype=torch.int32, device=device)
    return BeamState(
        running_sequences=running_sequences,
        running_scores=running_scores,
        running_beam_indices=beam_indices,
        sequences=running_sequences.clone(),
        beam_scores=torch.full((batch, num_beams), _NEG, dtype=torch.float32, device=device),
        beam_indices=beam_indices.clone(),
        is_sent_finished=torch.zeros(batch, num_beams, dtype=torch.bool, device=device),
        improvable=torch.ones(batch, 1, dtype=torch.bool, device=device),
        hits=torch.zeros(batch, opts.beams_to_keep, dtype=torch.bool, device=device),
        cur_len=torch.tensor(prompt_len, dtype=torch.int64, device=device),
        prompt_len=torch.tensor(prompt_len, dtype=torch.int64, device=device),
        max_length=torch.tensor(request.max_length, dtype=torch.int64, device=device),
        positions=None,
        done=torch.zeros((), dtype=torch.bool, device=device),
        keys=request.keys if opts.do_sample else None,
        cache=None,
        scores=None,
        logits=None,
        attentions=None,
        hidden_states=None,
        prefill_attentions=None,
        prefill_hidden_states=None,
        nonfinite=torch.zeros(batch, dtype=torch.bool, device=device),
        options=opts,
        processors=request.processors,
        grammar_mask=request.grammar_mask,
    )


def step(model, state: BeamState) -> BeamState:
    """Feed every beam's newest token and take one beam step (pure; donates ``state``)."""
    opts = state.options
    rows = state.batch_size * state.num_beams
    flat = state.running_sequences.view(rows, state.max_cache_len)
    newest = flat.gather(1, (state.cur_len - 1).reshape(1, 1).expand(rows, 1))
    positions = state.positions + 1
    logits, cache, attentions, hidden_states = model_forward(
        model, newest, positions.unsqueeze(1), state.cache, attentions=opts.output_attentions, hidden_states=opts.output_hidden_states)
    state = state.replace(cache=cache, positions=positions,
                          attentions=attentions if opts.output_attentions else None,
                          hidden_states=hidden_states if opts.output_hidden_states else None)
    return _beam_step(state, logits[:, -1])


def _gather_beams(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor[b, index[b, j], ...]`` for ``tensor [B, K, ...]`` and ``index [B, J]``."""
    while index.dim() < tensor.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(tensor, index, dim=1)


def _length_power(length: torch.Tensor, length_penalty: float) -> torch.Tensor:
    """``length ** length_penalty`` as transformers computes it (a double, then float32 arithmetic)."""
    return (length.to(torch.float64) ** length_penalty).to(torch.float32)


def _hits_stopping_criteria(tokens: torch.Tensor, cur_len: torch.Tensor, max_length: torch.Tensor,
                            eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """``[B, K2]``: candidates whose new token (at column ``cur_len``) ends them."""
    hits = (cur_len + 1 >= max_length) | torch.zeros_like(tokens, dtype=torch.bool)
    if eos_token_ids:
        eos = torch.tensor(eos_token_ids, dtype=tokens.dtype, device=tokens.device)
        hits = hits | (tokens.unsqueeze(-1) == eos).any(-1)
    return hits


def _beam_step(state: BeamState, logits: torch.Tensor) -> BeamState:
    """One beam step of ``generate``: ``select_beams``, then the KV cache rows follow the beams:
    new row (b, j) continues old row (b, source of j), reordered in place."""
    state, beam_idx = select_beams(state, logits)
    return state.replace(cache=state.cache.reorder(beam_idx), positions=state.positions.index_select(0, beam_idx))


def select_beams(state: BeamState, logits: torch.Tensor) -> tuple[BeamState, torch.Tensor]:
    """Steps 1-3 and 5 of a beam step on the ``[B * K, V]`` logits of the running beams (pure,
    static shapes, no host sync): the new running beams and finished hypotheses, and ``beam_idx
    [B * K]``, the row each new beam continues. The caller makes the cache follow the beams
    (``generate``: ``cache.reorder``; continuous batching: forked block tables)."""
    opts = state.options
    batch, num_beams, width = state.running_sequences.shape
    rows = batch * num_beams
    vocab = logits.shape[-1]
    keep = opts.beams_to_keep
    cur_len, prompt_len = state.cur_len, state.prompt_len

    nonfinite = state.nonfinite
    if opts.check_finite:
        nonfinite = nonfinite | nonfinite_rows(logits).view(batch, num_beams).any(dim=1)

    # 1. Candidate scores: processed log-probs plus the running score of their beam.
    log_probs = torch.log_softmax(logits, dim=-1)
    if state.grammar_mask is not None:
        # A token the beam's grammar forbids scores -inf: never a candidate while an allowed one is
        # left (the host treats a beam with a -inf score as dead).
        log_probs = apply_token_bitmask(log_probs, state.grammar_mask)
    if state.processors is not None:
        # Beams move in lockstep: every row of the context has the same lengths.
        ctx = LogitsContext(tokens=state.running_sequences.view(rows, width), cur_len=cur_len.expand(rows),
                            prompt_len=prompt_len.expand(rows))
        log_probs = state.processors(log_probs, ctx)
    accumulated = (log_probs.reshape(batch, num_beams, vocab) + state.running_scores.unsqueeze(-1)).view(batch, -1)

    # 2. The K2 candidates to consider, best first.
    if opts.do_sample:
        # Gumbel-top-k draws K2 distinct candidates with softmax(accumulated) probabilities, in
        # the order sampling without replacement would (the law of torch.multinomial).
        counter = (cur_len - prompt_len).expand(batch)
        noise = grandom.gumbel(state.keys, counter, num_beams * vocab)
        top_indices = torch.topk(accumulated + noise, keep, dim=-1).indices
        top_log_probs = accumulated.gather(1, top_indices)
        top_log_probs, order = top_log_probs.sort(dim=-1, descending=True)
        top_indices = top_indices.gather(1, order)
    else:
        top_log_probs, top_indices = torch.topk(accumulated, keep, dim=-1)
    source_beam = top_indices // vocab  # [B, K2]
    new_tokens = top_indices % vocab
    row_offset = torch.arange(batch, device=logits.device).unsqueeze(1) * num_beams
    column = cur_len.reshape(1)
    candidates = _gather_beams(state.running_sequences, source_beam)  # [B, K2, N]
    candidates.index_copy_(2, column, new_tokens.unsqueeze(-1))
    candidate_beam_indices = _gather_beams(state.running_beam_indices, source_beam)
    candidate_beam_indices.index_copy_(2, (cur_len - prompt_len).reshape(1),
                                       (source_beam + row_offset).to(torch.int32).unsqueeze(-1))

    # 3a. Which candidates end here (EOS or max_length).
    hits = _hits_stopping_criteria(new_tokens, cur_len, state.max_length, opts.eos_token_ids)

    # 3b. The best K unfinished candidates keep running.
    running_log_probs = top_log_probs + hits.to(torch.float32) * _NEG
    next_beams = torch.topk(running_log_probs, num_beams, dim=-1).indices
    running_sequences = _gather_beams(candidates, next_beams)
    running_scores = running_log_probs.gather(1, next_beams)
    running_beam_indices = _gather_beams(candidate_beam_indices, next_beams)

    # 3c. Finished candidates among the top K compete for the K finished slots.
    top_k_mask = torch.arange(keep, device=logits.device) < num_beams
    just_finished = hits & top_k_mask.unsqueeze(0)
    finished_scores = top_log_probs / _length_power(cur_len + 1 - prompt_len, opts.length_penalty)
    if opts.early_stopping is True:
        full = state.is_sent_finished.all(dim=-1, keepdim=True)
        finished_scores = finished_scores + full.to(torch.float32) * _NEG
    finished_scores = finished_scores + (~state.improvable).to(torch.float32) * _NEG
    finished_scores = finished_scores + (~just_finished).to(torch.float32) * _NEG
    merged_scores = torch.cat((state.beam_scores, finished_scores), dim=1)
    best = torch.topk(merged_scores, num_beams, dim=-1).indices
    sequences = _gather_beams(torch.cat((state.sequences, candidates), dim=1), best)
    beam_scores = merged_scores.gather(1, best)
    beam_indices = _gather_beams(torch.cat((state.beam_indices, candidate_beam_indices), dim=1), best)
    is_sent_finished = torch.cat((state.is_sent_finished, just_finished), dim=1).gather(1, best)

    # 4. The row each new beam continues: new beam (b, j) follows old row (b, source of j).
    beam_idx = (source_beam.gather(1, next_beams) + row_offset).reshape(rows)

    # 5. Is the search over?
    cur_len = cur_len + 1
    if opts.early_stopping == "never" and opts.length_penalty > 0.0:
        best_length = state.max_length - prompt_len
    else:
        best_length = cur_len - prompt_len
    best_running = running_scores[:, :1] / _length_power(best_length, opts.length_penalty)
    worst_finished = torch.where(is_sent_finished, beam_scores.min(dim=1, keepdim=True).values,
                                 torch.full_like(beam_scores, _NEG))
    improvable = state.improvable & (best_running > worst_finished).any(dim=-1, keepdim=True)
    unfinished = improvable.any() & ~hits.all()
    if opts.early_stopping is True:
        unfinished = unfinished & ~is_sent_finished.all()

    return state.replace(
        running_sequences=running_sequences,
        running_scores=running_scores,
        running_beam_indices=running_beam_indices,
        sequences=sequences,
        beam_scores=beam_scores,
        beam_indices=beam_indices,
        is_sent_finished=is_sent_finished,
        improvable=improvable,
        hits=hits,
        cur_len=cur_len,
        done=~unfinished,
        nonfinite=nonfinite,
        scores=log_probs if opts.output_scores else None,
        logits=logits if opts.output_logits else None,
    ), beam_idx


def collect(state: BeamState, trace: StepTrace) -> None:
    """Record what the output asked for after a step (the driver calls this between steps)."""
    opts = state.options
    if opts.output_scores:
        trace.scores.append(state.scores)
    if opts.output_logits:
        trace.logits.append(state.logits)
    collect_model_outputs(state, trace, opts.output_attentions, opts.output_hidden_states)


def finish(state: BeamState, trace: StepTrace, request: GenerationRequest):
    """The best ``num_return_sequences`` hypotheses per prompt: ``[B * num_return_sequences, L]``
    (or a ``GenerateBeamDecoderOnlyOutput``), cropped to the longest one returned."""
    opts = state.options
    batch, _, width = state.sequences.shape
    count = opts.num_return_sequences
    sequences = state.sequences[:, :count].reshape(batch * count, width)
    beam_indices = state.beam_indices[:, :count].reshape(batch * count, width)
    generated = int((beam_indices != -1).sum(dim=1).max())
    prompt_len = request.prompt_len
    sequences = sequences[:, : prompt_len + generated].clone()
    if not request.config.return_dict_in_generate:
        return sequences
    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=state.beam_scores[:, :count].reshape(-1).clone() if opts.output_scores else None,
        scores=tuple(trace.scores) if opts.output_scores else None,
        logits=tuple(trace.logits) if opts.output_logits else None,
        beam_indices=beam_indices[:, :generated].clone(),
        attentions=tuple(trace.attentions) if opts.output_attentions else None,
        hidden_states=tuple(trace.hidden_states) if opts.output_hidden_states else None,
        cache=state.cache,
    )


# Beam search and beam sampling as a Strategy value: beams move in lockstep and are reordered
# every step, so there is no per-row sequence to stream or to show user stopping criteria.
BEAM = Strategy(name="beam_search", init=init, step=step, finish=finish, collect=collect, streams=False,
                outputs=OUTPUT_KINDS)
