"""ONE request resolution: a call's settings, processors, EOS ids, lengths, key and stop matcher.

``resolve_request(model, input_ids, generation_config, kwargs, ...)`` merges the settings like
transformers (kwargs > the ``GenerationConfig`` passed > the model's generation config > library
defaults), checks the prompt and the special tokens, resolves the lengths, builds the logits
processor chain with every number a per-row leaf, the sampling keys and the stop-string matcher,
and returns a ``GenerationRequest`` with the generation mode. ``generate`` runs it on a static
batch; continuous batching runs it on each request's one prompt row (``paged=True``: the cache
is the engine's, so no static-cache sizes are checked); the server and the CLI read the EOS ids
through :func:`stop_token_ids`. Choosing and running a strategy is the caller's business.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable

import torch

from genfn import inputs
from genfn import random as grandom
from genfn.config import GenerationConfig, GenerationMode, resolve_generation_config, resolve_lengths
from genfn.processors.chain import build_logits_processors
from genfn.stopping import stop_string_criteria
from genfn.strategies import encoder_decoder as encdec_strategy
from genfn.strategies.guidance import make_guidance_spec
from genfn.strategies.request import GenerationRequest

__all__ = ["ResolvedCall", "request_key", "resolve_request", "row_keys", "stop_matcher", "stop_token_ids"]


@dataclasses.dataclass(frozen=True)
class ResolvedCall:
    """What :func:`resolve_request` returns: the request a strategy's ``init`` takes and its mode."""

    request: GenerationRequest
    mode: GenerationMode


def stop_token_ids(config, tokenizer=None) -> tuple[int, ...]:
    """The ids a request ends on: ``config.eos_token_id`` (normalised by ``inputs.eos_token_ids``),
    else the tokenizer's EOS when the config names none (what a shell reports as ``stop``)."""
    ids = inputs.eos_token_ids(getattr(config, "eos_token_id", None) if config is not None else None)
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids = inputs.eos_token_ids(tokenizer.eos_token_id)
    return ids


def row_keys(key, batch_size: int) -> torch.Tensor:
    """``[B, 2]`` keys from ``key`` (a ``genfn.random`` key, an int seed, ``[B, 2]`` keys or None).

    None draws a seed from torch's global generator, so ``torch.manual_seed`` governs it the way
    transformers users expect; pass a key for reproducibility independent of it.
    """
    if key is None:
        key = grandom.key(int(torch.randint(0, 2**62, (), dtype=torch.int64)))
    elif isinstance(key, int) and not isinstance(key, bool):
        key = grandom.key(key)
    return grandom.as_row_keys(key, batch_size)


def request_key(seed=None, key=None):
    """A one-row request's key from ``seed=`` (an int) or ``key=`` (not both): what batching takes."""
    if seed is not None and key is not None:
        raise ValueError("give a request `seed=` or `key=`, not both")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"`seed` must be an int, got {type(seed).__name__}")
    return key if key is not None else seed


_MATCHERS: collections.OrderedDict = collections.OrderedDict()  # (tokenizer id, stops, device) -> (tokenizer, matcher)
_MATCHERS_SIZE = 64
_MATCHERS_LOCK = threading.Lock()


def stop_matcher(tokenizer, stop_strings, device):
    """The stop-string matcher of ``stop_strings``, kept per tokenizer object: building one (or even
    keying the stopping module's table cache, which reads the whole vocabulary) takes about a
    second for a 50k vocabulary, and a server's requests repeat the same few stop strings."""
    stops = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)
    if tokenizer is None or not all(isinstance(s, str) for s in stops):
        return stop_string_criteria(tokenizer, stop_strings, device)  # raises the usual errors
    cache_key = (id(tokenizer), stops, str(device))
    with _MATCHERS_LOCK:
        entry = _MATCHERS.get(cache_key)
        if entry is not None and entry[0] is tokenizer:  # the entry holds the tokenizer: its id stays its own
            _MATCHERS.move_to_end(cache_key)
            return entry[1]
    matcher = stop_string_criteria(tokenizer, list(stops), device)
    with _MATCHERS_LOCK:
        _MATCHERS[cache_key] = (tokenizer, matcher)
        while len(_MATCHERS) > _MATCHERS_SIZE:
            _MATCHERS.popitem(last=False)
    return matcher


def _tokenizer_size(tokenizer) -> int | None:
    """``len(tokenizer)`` when it has one (None for a tokenizer-like object without it)."""
    try:
        size = len(tokenizer) if tokenizer is not None else None
    except TypeError:
        return None
    return size if isinstance(size, int) and size > 0 else None


def resolve_request(model, input_ids, generation_config: GenerationConfig | None = None, kwargs: dict | None = None,
                    *, key=None, attention_mask=None, logits_processor=None, prefix_allowed_tokens_fn=None,
                    tokenizer=None, negative_prompt_ids=None, negative_prompt_attention_mask=None,
                    assistant_model=None, heal=None, paged: bool = False, length_cap: int | None = None,
                    check_config: Callable[[GenerationConfig], None] | None = None,
                    expand_rows: bool = True, caller: str = "generate()") -> ResolvedCall:
    """Resolve one call into a ``GenerationRequest`` and its mode.

    ``heal``: ``heal_tokens``' ``generate`` (token healing runs one greedy step of it). ``paged``:
    the cache is continuous batching's paged one, so the static-cache sizes are not checked.
    ``length_cap``: the most tokens a request may hold, which caps a default ``max_length``.
    ``check_config``: the caller's refusals, run on the merged config before anything is built.
    ``expand_rows=False``: the ``num_return_sequences`` sequences of a prompt are the caller's own
    requests (continuous batching): the prompt rows are not repeated, but ``keys`` holds every
    sequence's key, row ``j`` the key ``generate`` gives the prompt's ``j``-th sequence.
    """
    kwargs = dict(kwargs or {})
    inputs.check_model(model)
    input_ids = inputs.as_input_ids(input_ids)
    encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
    if isinstance(kwargs.get("decoder_start_token_id"), torch.Tensor):
        kwargs["decoder_start_token_id"] = kwargs["decoder_start_token_id"].reshape(-1).tolist()
    config, unused = resolve_generation_config(model.generation_config, generation_config, kwargs)
    if encoder_decoder:
        # transformers routes the decoder_-prefixed kwargs (and encoder_outputs) to the model.
        decoder_kwargs, encoder_outputs, unused = encdec_strategy.split_model_kwargs(unused)
    if unused:
        raise ValueError(f"{caller} got arguments that are not generation settings (nor used by the model): "
                         f"{sorted(unused)}")
    if check_config is not None:
        check_config(config)
    mode = config.get_generation_mode(assistant_model)
    inputs.check_token_range(input_ids, model.vocab_size)
    inputs.check_special_tokens(config, model.vocab_size)
    eos_ids = inputs.eos_token_ids(config.eos_token_id)
    pad_id = inputs.resolve_pad_token_id(config.pad_token_id, eos_ids)
    encoder = None
    if encoder_decoder:
        # From here on input_ids are the decoder's prompt; the encoder's side travels in the request.
        encoder, input_ids, attention_mask = encdec_strategy.prepare_inputs(
            config, input_ids, attention_mask, decoder_kwargs, encoder_outputs, config.pad_token_id, eos_ids)
        inputs.check_token_range(input_ids, model.vocab_size)
        inputs.check_prompt_fits(encoder.input_ids.shape[1], model.max_position_embeddings)
        unsupported = [name for name, on in (("token_healing", config.token_healing),
                                             ("guidance_scale", config.guidance_scale not in (None, 1)))
                       if on]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)} are not supported with encoder-decoder models")
    else:
        attention_mask = inputs.attention_mask_for(input_ids, attention_mask, config.pad_token_id, eos_ids)
    if config.token_healing:
        if heal is None:
            raise ValueError(f"token_healing is not supported by {caller}")
        from genfn.healing import heal_tokens

        # Imperative preprocessing, like transformers' heal_tokens: rewrite each prompt's tail.
        input_ids, attention_mask = heal_tokens(model, input_ids, tokenizer, attention_mask, generate=heal)
    # transformers' _expand_inputs_for_generation: every prompt row repeated (consecutively) once
    # per beam / returned sample; the processors and the strategies see the expanded rows.
    num_beams = int(config.num_beams or 1)
    expand = max(num_beams, int(config.num_return_sequences or 1))
    key_rows = input_ids.shape[0] * expand // num_beams
    if expand > 1 and expand_rows:
        input_ids = input_ids.repeat_interleave(expand, dim=0)
        attention_mask = attention_mask.repeat_interleave(expand, dim=0)

    batch, prompt_len = input_ids.shape
    max_pos = model.max_position_embeddings
    inputs.check_prompt_fits(prompt_len, max_pos)
    max_length, min_length = resolve_lengths(config, prompt_len, max_pos)
    if length_cap is not None and config.max_new_tokens is None:
        max_length = min(max_length, length_cap)
    max_cache_len = max_length
    if not paged:
        inputs.warn_beyond_context(max_length, max_pos)
        max_cache_len = config.max_cache_len if config.max_cache_len is not None else max_length
        if prompt_len >= max_cache_len:
            raise ValueError(f"the prompt has {prompt_len} tokens, which leaves no room in "
                             f"max_cache_len={max_cache_len}")
        if max_length > max_cache_len:
            raise ValueError(f"max_length={max_length} (prompt {prompt_len} + new tokens) exceeds "
                             f"max_cache_len={max_cache_len}; raise max_cache_len or lower max_new_tokens")
        inputs.check_generation_memory(model, batch, max_cache_len, config.cache_implementation)

    processors = build_logits_processors(
        config, prompt_len=prompt_len, max_length=max_length, min_length=min_length, eos_token_ids=list(eos_ids),
        num_beams=num_beams, encoder_input_ids=None if encoder is None else encoder.input_ids,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, user_processors=logits_processor,
        attention_mask=attention_mask, vocab_size=model.vocab_size, device=input_ids.device)
    requires = dict(processors.requires)
    requires.pop("token_healing", None)  # done above
    guidance = None
    if "guidance_scale" in requires:
        guidance = make_guidance_spec(requires.pop("guidance_scale"), negative_prompt_ids,
                                      negative_prompt_attention_mask, batch, expand, model.vocab_size)
    if requires:
        raise ValueError(f"these settings need model-level support that {caller} does not provide yet: "
                         f"{sorted(requires)}")
    stop_strings = None
    if config.stop_strings is not None:
        stop_strings = stop_matcher(tokenizer, config.stop_strings, input_ids.device)
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
        # The step's chain: every number a [B] tensor leaf, so new values never recompile.
        processors=processors.per_row(batch, input_ids.device) if len(processors) else None,
        # One key per sampled row; beam sampling draws per prompt (over all its beams' candidates).
        keys=row_keys(key, key_rows) if config.do_sample else None,
        output_scores=return_dict and bool(config.output_scores),
        output_logits=return_dict and bool(config.output_logits),
        output_attentions=return_dict and bool(config.output_attentions),
        output_hidden_states=return_dict and bool(config.output_hidden_states),
        stop_strings=stop_strings,
        guidance=guidance,
        encoder=encoder,
        tokenizer_size=_tokenizer_size(tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)),
    )
    return ResolvedCall(request, mode)
