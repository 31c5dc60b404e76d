"""``generate``: the transformers-shaped entry point over the functional strategies.

It does the imperative chores (resolve the config, validate and pad inputs, build the processor
chain, choose the strategy, run the driver, package the outputs) and nothing else: every
decision about tokens is made inside a strategy's pure step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Callable, Sequence

import torch

from genfn import driver
from genfn.custom_generate import load_custom_generate
from genfn.kernels.invariant import deterministic
from genfn.resolve import resolve_request
from genfn.config import GenerationConfig, GenerationMode
from genfn.strategies import beam as beam_strategy
from genfn.strategies import encoder_decoder as encdec_strategy
from genfn.strategies.assisted.build import assisted_strategy
from genfn.strategies import sample as sample_strategy
from genfn.stopping import call_user_criteria
from genfn.strategies.base import Strategy
from genfn.strategies.request import GenerationRequest, StepTrace
from genfn.streamers import close_stream
from genfn.config.response_format import parse_response_format, per_row_formats
from genfn.structured.beams import BeamGrammarRows
from genfn.structured.rows import constraint_for_rows
from genfn.structured.speculative import SpeculativeGrammarRows

__all__ = ["generate"]

# The built-in strategy that runs each mode.
STRATEGIES = {
    GenerationMode.GREEDY_SEARCH: sample_strategy.SAMPLE,
    GenerationMode.SAMPLE: sample_strategy.SAMPLE,
    GenerationMode.BEAM_SEARCH: beam_strategy.BEAM,
    GenerationMode.BEAM_SAMPLE: beam_strategy.BEAM,
}


class _EndOnce:
    """The caller's streamer, closed exactly once whichever way generation exits: ended after
    success, failed with the error otherwise (so a consumer thread never waits forever)."""

    def __init__(self, streamer):
        self.streamer = streamer
        self.closed = False

    def put(self, value) -> None:
        self.streamer.put(value)

    def end(self) -> None:
        self.fail(None)

    def fail(self, error: BaseException | None) -> None:
        if not self.closed:
            self.closed = True
            if callable(getattr(self.streamer, "end", None)):  # a non-streamer was refused by name
                close_stream(self.streamer, error)


def generate(
    model,
    input_ids=None,
    generation_config: GenerationConfig | None = None,
    *,
    key: torch.Tensor | int | None = None,
    attention_mask: torch.Tensor | None = None,
    logits_processor: Sequence | None = None,
    stopping_criteria: Sequence | None = None,
    prefix_allowed_tokens_fn=None,
    streamer=None,
    strategy: Strategy | None = None,
    custom_generate=None,
    compile_loop: bool = False,
    assistant_model=None,
    synced_gpus: bool | None = None,
    trust_remote_code: bool = False,
    **kwargs,
):
    """Generate continuations of ``input_ids`` with ``model``.

    Settings merge like transformers: ``kwargs`` > ``generation_config`` > the model's
    generation_config.json > library defaults. ``key`` (a ``genfn.random.key``, an int seed, or
    one key per row ``[B, 2]``) drives sampling; row ``i`` of a single key uses
    ``fold_in(key, i)``. Returns the sequences ``[B, prompt + new]`` or, with
    ``return_dict_in_generate=True``, a ``Generate*Output``.

    ``strategy`` runs any :class:`~genfn.strategies.base.Strategy` (yours included) through the
    same driver instead of the one the config's mode selects, with streaming, stopping criteria,
    ``max_time``, per-step outputs and the compiled path. ``custom_generate``: a ``Strategy`` (the
    same as ``strategy=``), or a callable that replaces the decoding loop, as in transformers:
    genfn prepares the inputs, config, processors and criteria, then returns
    ``custom_generate(model, input_ids, logits_processor=..., stopping_criteria=...,
    generation_config=..., streamer=..., attention_mask=..., request=...)``; or a directory (path or
    cached Hub id) holding ``custom_generate/generate.py``, whose ``generate`` is then called the
    same way; it runs code from disk, so it needs ``trust_remote_code=True``.

    As in transformers, ``tokenizer=`` is required by ``stop_strings`` and ``token_healing``, and
    ``negative_prompt_ids`` / ``negative_prompt_attention_mask`` feed ``guidance_scale``.

    ``assistant_model`` (a genfn ``Model`` with the same vocabulary), ``prompt_lookup_num_tokens``
    or ``assistant_early_exit`` select assisted (speculative) generation at any batch size; its
    output equals plain decoding's, and ``return_dict_in_generate=True`` adds ``acceptance``. An
    ``assistant_model`` with another tokenizer needs ``tokenizer=`` and ``assistant_tokenizer=``
    (universal assisted generation: drafts re-encoded through text on the host, eagerly, at any
    batch size; ``assistant_lookbehind`` / ``target_lookbehind`` size the re-encoded windows).

    ``synced_gpus`` is accepted for transformers compatibility: it keeps every rank stepping until
    all ranks finish, under data-parallel sharding (DeepSpeed ZeRO-3, FSDP). genfn runs one process
    on one device, so there is nothing to synchronize and it changes nothing.

    ``compile_loop=True`` (greedy or sampling with ``cache_implementation="static"``) runs the
    whole decoding loop as one graph (torch ``while_loop``) instead of one compiled step per token;
    nothing can run on the host between steps, so it excludes streamers, stopping criteria,
    ``max_time`` and per-step outputs.
    """
    start_time = time.monotonic()
    if synced_gpus is not None and not isinstance(synced_gpus, bool):
        raise TypeError(f"synced_gpus must be a bool or None, got {type(synced_gpus).__name__}")
    streamer = _EndOnce(streamer) if streamer is not None else None
    try:
        request, chosen = prepare_request(model, input_ids, generation_config, key=key, attention_mask=attention_mask,
                                          logits_processor=logits_processor,
                                          prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                                          assistant_model=assistant_model, **kwargs)
        criteria = user_criteria(stopping_criteria)
        if custom_generate is not None:
            if isinstance(custom_generate, (str, os.PathLike)):
                custom_generate = load_custom_generate(custom_generate, trust_remote_code=trust_remote_code)
            if isinstance(custom_generate, Strategy):
                strategy = custom_generate
            elif callable(custom_generate):
                return custom_generate(model, request.input_ids, logits_processor=request.processors,
                                       stopping_criteria=criteria, generation_config=request.config,
                                       streamer=streamer.streamer if streamer else None,
                                       attention_mask=request.attention_mask, request=request)
            else:
                raise ValueError(f"custom_generate must be a genfn Strategy, a callable, or a directory holding "
                                 f"custom_generate/generate.py; got {type(custom_generate).__name__}")
        if strategy is not None and not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a genfn.strategies.base.Strategy, got {type(strategy).__name__}")
        strategy = strategy or chosen
        _check_capabilities(strategy, request, streamer, criteria)
        if streamer is not None and not (callable(getattr(streamer.streamer, "put", None))
                                         and callable(getattr(streamer.streamer, "end", None))):
            raise TypeError(f"streamer must have put(tokens) and end() methods (a genfn or transformers streamer); got "
                            f"{type(streamer.streamer).__name__}")
        if request.grammar is not None and strategy is not chosen:
            raise ValueError(f"response_format is applied by genfn's own strategies; the {strategy.name!r} strategy "
                             "given as strategy=/custom_generate= does not read the grammar mask")
        if compile_loop:
            _check_compile_loop(request, strategy, streamer, criteria)
        if streamer is not None:
            streamer.put(request.input_ids.cpu())
        config = request.config
        # batch_invariant=True: the whole call in the mode; unset or False leaves the caller's mode.
        with deterministic() if config.batch_invariant else contextlib.nullcontext():
            state = strategy.init(model, request)
            compile_options = None
            if strategy.compiles and (request.processors is None or request.processors.compile_safe):
                compile_options = driver.compile_options_for(config, model.device, whole_loop=compile_loop)
            trace = StepTrace()
            num_steps = request.max_length - request.prompt_len - 1
            if compile_loop:
                strategy.collect(state, trace)
                state = driver.compiled_loop(strategy.step, model, state, compile_options)(state, num_steps)
            else:
                state = driver.run(strategy, model, state, num_steps=num_steps, streamer=streamer,
                                   stopping_criteria=criteria, compile_options=compile_options,
                                   max_time=config.max_time, start_time=start_time, trace=trace,
                                   constraint=request.grammar)
            result = strategy.finish(state, trace, request)
    except BaseException as error:
        if streamer is not None:
            streamer.fail(error)
        raise
    if streamer is not None:
        streamer.end()
    return result


def user_criteria(stopping_criteria) -> Callable | None:
    """``stopping_criteria`` as one ``(input_ids, scores) -> [B] bool`` callable (None when empty)."""
    if not stopping_criteria:
        return None
    return lambda input_ids, scores: call_user_criteria(stopping_criteria, input_ids, scores)


def _check_capabilities(strategy: Strategy, request: GenerationRequest, streamer, criteria) -> None:
    """Refuse combinations the strategy does not declare, naming both."""
    if streamer is not None and not strategy.streams:
        raise ValueError(f"streamer is only supported by strategies that stream (greedy search and sampling, "
                         f"num_beams=1, as in transformers); the {strategy.name!r} strategy does not")
    if criteria is not None and not strategy.streams:
        raise ValueError(f"custom stopping_criteria are not supported by the {strategy.name!r} strategy "
                         f"(beam search keeps no per-row sequence to show them)")
    if streamer is not None and strategy.tokens_per_step > 1 and request.batch_size > 1:
        raise ValueError(f"streamer needs batch size 1 with the {strategy.name!r} strategy (it appends up to "
                         f"{strategy.tokens_per_step} tokens per step)")
    wanted = {"scores": request.output_scores, "logits": request.output_logits,
              "attentions": request.output_attentions, "hidden_states": request.output_hidden_states}
    missing = sorted(name for name, asked in wanted.items() if asked and name not in strategy.outputs)
    if missing:
        raise ValueError(f"the {strategy.name!r} strategy cannot return {', '.join('output_' + m for m in missing)}")


def _check_compile_loop(request: GenerationRequest, strategy: Strategy, streamer, stopping_criteria) -> None:
    """compile_loop runs every step inside one graph: reject what needs the host between steps."""
    config = request.config
    if not strategy.whole_loop:
        raise ValueError(f"compile_loop supports greedy search and sampling (num_beams=1), not beam search or the "
                         f"{strategy.name!r} strategy")
    if config.cache_implementation != "static":
        raise ValueError(f"compile_loop needs cache_implementation='static' (a fixed-shape cache), got "
                         f"{config.cache_implementation!r}")
    blockers = {
        "streamer": streamer is not None,
        "stopping_criteria": stopping_criteria is not None,
        "max_time": config.max_time is not None,
        "output_scores/output_logits/output_attentions/output_hidden_states": (
            request.output_scores or request.output_logits or request.output_attentions
            or request.output_hidden_states),
        "prefix_allowed_tokens_fn": request.processors is not None and not request.processors.compile_safe,
        "response_format": request.grammar is not None,
    }
    needs_host = [name for name, present in blockers.items() if present]
    if needs_host:
        raise ValueError(f"compile_loop runs the loop without returning to Python between steps; it cannot be "
                         f"combined with {', '.join(needs_host)}")


def _grammar_rows(model, tokenizer, config, num_prompts: int, expand: int, prompt_len: int, eos_ids, device, mode,
                  encoder_decoder: bool):
    """The host-side matchers of ``config.response_format`` (one per expanded row), or None."""
    if config.response_format is None:
        return None
    formats = per_row_formats(config.response_format, num_prompts, expand)
    if all(parse_response_format(f) is None for f in formats):
        return None
    speculative = mode is GenerationMode.ASSISTED_GENERATION
    if encoder_decoder or not (mode in STRATEGIES or speculative):
        raise ValueError(f"response_format is supported with greedy search, sampling, beam search and speculative "
                         f"decoding on decoder-only models; this call's mode is {mode.value!r}")
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    rows = constraint_for_rows(tokenizer, formats, vocab_size=model.vocab_size, start=[prompt_len] * len(formats),
                               eos_token_ids=eos_ids, device=device, engine=config.grammar_engine)
    if rows is not None and speculative:
        return SpeculativeGrammarRows.from_rows(rows)
    if rows is not None and STRATEGIES[mode] is beam_strategy.BEAM:
        return BeamGrammarRows.from_rows(rows, prompt_len)
    return rows


def prepare_request(model, input_ids, generation_config=None, *, key=None, attention_mask=None,
                    logits_processor=None, prefix_allowed_tokens_fn=None, tokenizer=None, negative_prompt_ids=None,
                    negative_prompt_attention_mask=None, assistant_model=None, assistant_tokenizer=None, **kwargs):
    """Resolve a call (``genfn.resolve.resolve_request``) into a ``GenerationRequest`` and the
    strategy that runs it.

    ``tokenizer`` is needed for ``stop_strings`` and ``token_healing`` (as in transformers), and with
    ``assistant_tokenizer`` for an ``assistant_model`` whose tokenizer differs (universal assisted generation);
    ``negative_prompt_ids`` / ``negative_prompt_attention_mask`` give classifier-free guidance
    (``guidance_scale``) its unconditional prompt (default: each prompt row's last token).
    """
    resolved = resolve_request(model, input_ids, generation_config, kwargs, key=key, attention_mask=attention_mask,
                               logits_processor=logits_processor, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                               tokenizer=tokenizer, negative_prompt_ids=negative_prompt_ids,
                               negative_prompt_attention_mask=negative_prompt_attention_mask,
                               assistant_model=assistant_model, heal=generate)
    request, mode = resolved.request, resolved.mode
    encoder_decoder = request.encoder is not None
    if mode not in STRATEGIES and mode is not GenerationMode.ASSISTED_GENERATION:
        raise ValueError(f"generation mode {mode.value!r} is not supported; supported: "
                         f"{[m.value for m in STRATEGIES]}")
    beam = STRATEGIES.get(mode) is beam_strategy.BEAM
    if beam and (request.guidance is not None or request.stop_strings is not None):
        raise ValueError("stop_strings and guidance_scale are supported for greedy search and sampling "
                         "(num_beams=1); not with beam search yet")
    config = request.config
    batch, prompt_len = request.input_ids.shape
    expand = max(int(config.num_beams or 1), int(config.num_return_sequences or 1))
    grammar = _grammar_rows(model, tokenizer, config, batch // expand, expand, prompt_len, request.eos_token_ids,
                            request.input_ids.device, mode, encoder_decoder)
    if grammar is not None:
        request = dataclasses.replace(request, grammar=grammar, grammar_mask=grammar.mask())
    if mode is GenerationMode.ASSISTED_GENERATION:
        if encoder_decoder:
            raise ValueError("assisted generation (assistant_model, prompt_lookup_num_tokens, assistant_early_exit) "
                             "is not supported with encoder-decoder models")
        return request, assisted_strategy(model, request, assistant_model, tokenizer=tokenizer,
                                          assistant_tokenizer=assistant_tokenizer)
    if assistant_tokenizer is not None:
        raise ValueError("assistant_tokenizer= is only used by assisted generation with an assistant_model")
    chosen = STRATEGIES[mode]
    return request, (encdec_strategy.for_encoder_decoder(chosen) if encoder_decoder else chosen)
