"""``generate``: the transformers-shaped entry point over the functional strategies.

It does the imperative chores (resolve the config, validate and pad inputs, build the processor
chain, choose the strategy, run the driver, package the outputs) and nothing else: every
decision about tokens is made inside a strategy's pure step.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from genfn import driver
from genfn import inputs
from genfn import random as grandom
from genfn.config import GenerationConfig, GenerationMode, resolve_generation_config, resolve_lengths
from genfn.processors.chain import build_logits_processors
from genfn.strategies import beam as beam_strategy
from genfn.strategies import sample as sample_strategy
from genfn.stopping import call_user_criteria, stop_string_criteria
from genfn.strategies.guidance import make_guidance_spec
from genfn.strategies.request import GenerationRequest, StepTrace

__all__ = ["generate"]

# The strategy module that runs each mode: it exposes init / step / finish (and collect).
STRATEGIES = {
    GenerationMode.GREEDY_SEARCH: sample_strategy,
    GenerationMode.SAMPLE: sample_strategy,
    GenerationMode.BEAM_SEARCH: beam_strategy,
    GenerationMode.BEAM_SAMPLE: beam_strategy,
}
_COMPILABLE_CACHES = ("static", "offloaded_static")


def _row_keys(key, batch_size: int) -> torch.Tensor:
    if key is None:
        # No key given: draw one from torch's global generator, so `torch.manual_seed` governs it
        # the way transformers users expect. Pass a key for reproducibility independent of it.
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        key = grandom.key(seed)
    elif isinstance(key, int) and not isinstance(key, bool):
        key = grandom.key(key)
    return grandom.as_row_keys(key, batch_size)


# What a CPU step compiles with when compile_config names no mode (or transformers' default,
# "reduce-overhead", which means CUDA graphs and does nothing on a CPU): the options of mode
# "max-autotune-no-cudagraphs" plus the C++ wrapper. max-autotune lets inductor pick its own GEMM
# kernels for the frozen weights wherever genfn's decode kernel does not take a linear (bfloat16
# past 4 rows); the C++ wrapper calls the step's ~500 kernels without Python in between (SmolLM2
# bf16 b=1: 18.4 -> 16.6 ms/step, f32 b=8: 44.7 -> 43.6, interleaved in one process).
_CPU_COMPILE_OPTIONS = {"max_autotune": True, "coordinate_descent_tuning": True, "cpp_wrapper": True}


def _compile_options(config: GenerationConfig, device: torch.device, whole_loop: bool = False) -> dict | None:
    if config.disable_compile or config.cache_implementation not in _COMPILABLE_CACHES:
        return None
    compile_config = config.compile_config
    options = {"fullgraph": True}
    if compile_config is not None:
        options = {k: v for k, v in compile_config.to_dict().items() if v is not None}
    mode = options.get("mode")
    if mode == "reduce-overhead" or (mode is None and "options" not in options):
        if device.type == "cpu" and options.get("backend", "inductor") == "inductor":
            options.pop("mode", None)  # torch.compile takes a mode or options, not both
            options["options"] = dict(_CPU_COMPILE_OPTIONS)
            if whole_loop:
                # A while_loop's C++ wrapper inlines every layer's kernels into one ~1 MB source
                # (SmolLM2: over 8 minutes of g++ -O3); the loop has no per-step Python to save.
                options["options"].pop("cpp_wrapper")
        else:
            options.pop("mode", None)  # CUDA graphs would capture the donated buffers' addresses
    return options


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
    compile_loop: bool = False,
    **kwargs,
):
    """Generate continuations of ``input_ids`` with ``model``.

    Settings merge like transformers: ``kwargs`` > ``generation_config`` > the model's
    generation_config.json > library defaults. ``key`` (a ``genfn.random.key``, an int seed, or
    one key per row ``[B, 2]``) drives sampling; row ``i`` of a single key uses
    ``fold_in(key, i)``. Returns the sequences ``[B, prompt + new]`` or, with
    ``return_dict_in_generate=True``, a ``Generate*Output``.

    As in transformers, ``tokenizer=`` is required by ``stop_strings`` and ``token_healing``, and
    ``negative_prompt_ids`` / ``negative_prompt_attention_mask`` feed ``guidance_scale``.

    ``compile_loop=True`` (greedy or sampling with ``cache_implementation="static"``) runs the
    whole decoding loop as one graph (torch ``while_loop``) instead of one compiled step per token;
    nothing can run on the host between steps, so it excludes streamers, stopping criteria,
    ``max_time`` and per-step outputs.
    """
    start_time = time.monotonic()
    request, strategy = prepare_request(model, input_ids, generation_config, key=key, attention_mask=attention_mask,
                                        logits_processor=logits_processor,
                                        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, **kwargs)
    if compile_loop:
        _check_compile_loop(request, strategy, streamer, stopping_criteria)
    if streamer is not None and strategy is not sample_strategy:
        raise ValueError("streamer is only supported for greedy search and sampling (num_beams=1), as in transformers")
    if stopping_criteria and strategy is beam_strategy:
        raise ValueError("custom stopping_criteria are not supported with beam search (num_beams > 1) yet")
    config = request.config
    trace = StepTrace()
    host_len = request.prompt_len + 1  # sequence length after the latest step, known without a sync

    if streamer is not None:
        streamer.put(request.input_ids.cpu())
    state = strategy.init(model, request)

    def after_step(new_state):
        nonlocal host_len
        strategy.collect(new_state, trace)
        if streamer is not None:
            streamer.put(strategy.newest_tokens(new_state, host_len).cpu())
        host_len += 1

    extra_stop = None
    if stopping_criteria:
        def extra_stop(new_state):
            # User criteria are Python: they run eagerly between steps, on transformers' view.
            seq = new_state.tokens[:, :host_len]
            stop = _call_criteria(stopping_criteria, seq, new_state.scores)
            return new_state.replace(done=new_state.done | stop)
        state = extra_stop(state)
    after_step(state)

    compile_options = _compile_options(config, model.device, whole_loop=compile_loop)
    if compile_loop:
        loop = driver.compiled_loop(strategy.step, model, state, compile_options)
        state = loop(state, request.max_length - request.prompt_len - 1)
        return strategy.finish(state, trace, request)
    # Each step attends over the slots filled so far (host_len - 1 before the step), not over
    # max_cache_len: the span's size is dynamic, so one compiled step serves every length.
    state = driver.limit_attention(state, host_len - 1)
    if compile_options is not None:
        step_fn = driver.compiled_step(strategy.step, model, state, compile_options)
    else:
        step_fn = driver.eager_step(strategy.step, model)

    def advance(current):
        return step_fn(driver.limit_attention(current, host_len - 1))

    state = driver.run_loop(advance, state, num_steps=request.max_length - request.prompt_len - 1,
                            all_done=lambda s: bool(s.done.all()), on_step=after_step, max_time=config.max_time,
                            start_time=start_time, extra_stop=extra_stop)
    if streamer is not None:
        streamer.end()
    return strategy.finish(state, trace, request)


def _check_compile_loop(request: GenerationRequest, strategy, streamer, stopping_criteria) -> None:
    """compile_loop runs every step inside one graph: reject what needs the host between steps."""
    config = request.config
    if strategy is not sample_strategy:
        raise ValueError("compile_loop supports greedy search and sampling (num_beams=1), not beam search")
    if config.cache_implementation != "static":
        raise ValueError(f"compile_loop needs cache_implementation='static' (a fixed-shape cache), got "
                         f"{config.cache_implementation!r}")
    blockers = {
        "streamer": streamer is not None,
        "stopping_criteria": bool(stopping_criteria),
        "max_time": config.max_time is not None,
        "output_scores/output_logits/output_attentions/output_hidden_states": (
            request.output_scores or request.output_logits or request.output_attentions
            or request.output_hidden_states),
        "prefix_allowed_tokens_fn": request.processors is not None and not request.processors.compile_safe,
    }
    needs_host = [name for name, present in blockers.items() if present]
    if needs_host:
        raise ValueError(f"compile_loop runs the loop without returning to Python between steps; it cannot be "
                         f"combined with {', '.join(needs_host)}")


def prepare_request(model, input_ids, generation_config=None, *, key=None, attention_mask=None,
                    logits_processor=None, prefix_allowed_tokens_fn=None, tokenizer=None, negative_prompt_ids=None,
                    negative_prompt_attention_mask=None, **kwargs):
    """Validate and resolve a call into a ``GenerationRequest`` and the strategy module that runs it.

    ``tokenizer`` is needed for ``stop_strings`` and ``token_healing`` (as in transformers);
    ``negative_prompt_ids`` / ``negative_prompt_attention_mask`` give classifier-free guidance
    (``guidance_scale``) its unconditional prompt (default: each prompt row's last token).
    """
    input_ids = inputs.as_input_ids(input_ids)
    config, unused = resolve_generation_config(model.generation_config, generation_config, kwargs)
    if unused:
        raise ValueError(f"generate() got arguments that are neither generation settings nor used by the model: "
                         f"{sorted(unused)}")
    mode = config.get_generation_mode()
    if mode not in STRATEGIES:
        raise ValueError(f"generation mode {mode.value!r} is not supported; supported: "
                         f"{[m.value for m in STRATEGIES]}")
    inputs.check_token_range(input_ids, model.vocab_size)
    inputs.check_special_tokens(config, model.vocab_size)
    eos_ids = inputs.eos_token_ids(config.eos_token_id)
    pad_id = inputs.resolve_pad_token_id(config.pad_token_id, eos_ids)
    attention_mask = inputs.attention_mask_for(input_ids, attention_mask, config.pad_token_id, eos_ids)
    if config.token_healing:
        # Imperative preprocessing, like transformers' heal_tokens: rewrite each prompt's tail.
        from genfn.healing import heal_tokens

        input_ids, attention_mask = heal_tokens(model, input_ids, tokenizer, attention_mask)
    # transformers' _expand_inputs_for_generation: every prompt row repeated (consecutively) once
    # per beam / returned sample; the processors and the strategies see the expanded rows.
    num_beams = int(config.num_beams or 1)
    expand = max(num_beams, int(config.num_return_sequences or 1))
    if expand > 1:
        input_ids = input_ids.repeat_interleave(expand, dim=0)
        attention_mask = attention_mask.repeat_interleave(expand, dim=0)

    batch, prompt_len = input_ids.shape
    max_pos = model.max_position_embeddings
    inputs.check_prompt_fits(prompt_len, max_pos)
    max_length, min_length = resolve_lengths(config, prompt_len, max_pos)
    inputs.warn_beyond_context(max_length, max_pos)
    max_cache_len = config.max_cache_len if config.max_cache_len is not None else max_length
    if prompt_len >= max_cache_len:
        raise ValueError(f"the prompt has {prompt_len} tokens, which leaves no room in max_cache_len={max_cache_len}")
    if max_length > max_cache_len:
        raise ValueError(f"max_length={max_length} (prompt {prompt_len} + new tokens) exceeds "
                         f"max_cache_len={max_cache_len}; raise max_cache_len or lower max_new_tokens")
    inputs.check_generation_memory(model, batch, max_cache_len, config.cache_implementation)

    processors = build_logits_processors(
        config, prompt_len=prompt_len, max_length=max_length, min_length=min_length, eos_token_ids=list(eos_ids),
        num_beams=num_beams, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, user_processors=logits_processor,
        attention_mask=attention_mask, vocab_size=model.vocab_size, device=input_ids.device)
    requires = dict(processors.requires)
    requires.pop("token_healing", None)  # done above
    guidance = None
    if "guidance_scale" in requires:
        guidance = make_guidance_spec(requires.pop("guidance_scale"), negative_prompt_ids,
                                      negative_prompt_attention_mask, batch, expand, model.vocab_size)
    if requires:
        raise ValueError(f"these settings need model-level support that generate does not provide yet: "
                         f"{sorted(requires)}")
    stop_strings = None
    if config.stop_strings is not None:
        stop_strings = stop_string_criteria(tokenizer, config.stop_strings, input_ids.device)
    if STRATEGIES[mode] is not sample_strategy and (guidance is not None or stop_strings is not None):
        raise ValueError("stop_strings and guidance_scale are supported for greedy search and sampling "
                         "(num_beams=1); not with beam search yet")
    return_dict = bool(config.return_dict_in_generate)
    request = GenerationRequest(
        input_ids=input_ids,
        attention_mask=attention_mask,
        config=config,
        max_length=max_length,
        min_length=min_length,
        max_cache_len=max_cache_len,
        eos_token_ids=eos_ids,
        pad_token_id=pad_id,
        processors=processors if len(processors) else None,
        processors_key=processors.fingerprint(),
        # One key per sampled row; beam sampling draws per prompt (over all its beams' candidates).
        keys=_row_keys(key, batch // num_beams) if config.do_sample else None,
        output_scores=return_dict and bool(config.output_scores),
        output_logits=return_dict and bool(config.output_logits),
        output_attentions=return_dict and bool(config.output_attentions),
        output_hidden_states=return_dict and bool(config.output_hidden_states),
        stop_strings=stop_strings,
        guidance=guidance,
    )
    return request, STRATEGIES[mode]


def _call_criteria(criteria, input_ids, scores) -> torch.Tensor:
    return call_user_criteria(criteria, input_ids, scores)
