"""A request's generation settings for continuous batching, resolved as ``generate`` resolves them.

``request_settings(model, prompt_ids, generation_config, kwargs)`` merges the settings like
``generate`` (kwargs > the config passed > the model's generation config > defaults) and builds
that request's own logits-processor chain for its prompt length and limits, with every number
a per-row leaf, so that chains of requests with different settings merge into one batch chain.
``seed=`` (an int) or ``key=`` (a ``genfn.random`` key) fixes the request's sampling noise; a
sampling request without either draws a seed from torch's global generator, as ``generate`` does.

OpenAI's settings that ``GenerationConfig`` lacks (``presence_penalty``, ``frequency_penalty``,
``logit_bias``: ``genfn.processors.openai_sampling``) join the chain where transformers merges
user processors: after the config's penalties, before the sampling warpers. ``top_logprobs``
(0..20) asks the step for that many most likely tokens per generated token.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import torch

from genfn import random as grandom
from genfn.batching.engine import RequestSettings
from genfn.config import GenerationConfig, resolve_generation_config, resolve_lengths
from genfn.processors.chain import build_logits_processors
from genfn.processors.openai_sampling import openai_processors
from genfn.structured.rows import constraint_for_rows

__all__ = ["MAX_TOP_LOGPROBS", "ResolvedRequest", "request_settings"]

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for `top_logprobs`

# Settings that need a model-level feature continuous batching does not run (another forward per
# token, several sequences per request, or the processor's own state across steps).
_UNSUPPORTED = {"num_beams": 1, "num_return_sequences": 1, "guidance_scale": None, "token_healing": False,
                "watermarking_config": None, "penalty_alpha": None, "assistant_model": None,
                "prompt_lookup_num_tokens": None}


@dataclasses.dataclass(frozen=True)
class ResolvedRequest:
    settings: RequestSettings
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]


def _key(seed, key) -> torch.Tensor:
    if seed is not None and key is not None:
        raise ValueError("give a request `seed=` or `key=`, not both")
    if key is not None:
        return grandom.as_row_keys(key, 1)[0]
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"`seed` must be an int, got {type(seed).__name__}")
    # As generate(key=seed) for a batch of one: row 0 folds in 0.
    return grandom.as_row_keys(grandom.key(seed), 1)[0]


_MATCHERS: collections.OrderedDict = collections.OrderedDict()  # (tokenizer id, stops, device) -> (tokenizer, matcher)
_MATCHERS_SIZE = 64
_MATCHERS_LOCK = threading.Lock()


def _stop_matcher(tokenizer, stop_strings, device):
    """The stop-string matcher of ``stop_strings``, kept per tokenizer object: building one (or even
    keying the stopping module's table cache, which reads the whole vocabulary) takes about a
    second for a 50k vocabulary, and a server's requests repeat the same few stop strings."""
    from genfn.stopping import stop_string_criteria

    stops = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)
    if tokenizer is None or not all(isinstance(s, str) for s in stops):
        return stop_string_criteria(tokenizer, stop_strings, device)  # raises the usual errors
    key = (id(tokenizer), stops, str(device))
    with _MATCHERS_LOCK:
        entry = _MATCHERS.get(key)
        if entry is not None and entry[0] is tokenizer:  # the entry holds the tokenizer: its id stays its own
            _MATCHERS.move_to_end(key)
            return entry[1]
    matcher = stop_string_criteria(tokenizer, list(stops), device)
    with _MATCHERS_LOCK:
        _MATCHERS[key] = (tokenizer, matcher)
        while len(_MATCHERS) > _MATCHERS_SIZE:
            _MATCHERS.popitem(last=False)
    return matcher


def _top_logprobs(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`top_logprobs` must be an int in [0, {MAX_TOP_LOGPROBS}], got {type(value).__name__}")
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"`top_logprobs` must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
    return value


def _unsupported(config: GenerationConfig) -> list[str]:
    found = []
    for name, off in _UNSUPPORTED.items():
        value = getattr(config, name, off)
        if value is not None and value != off and not (name == "guidance_scale" and value == 1.0):
            found.append(f"{name}={value!r}")
    return found


def request_settings(model, prompt_ids, generation_config: GenerationConfig | None, kwargs: dict, *,
                     max_new_tokens: int | None = None, eos_token_id=None, max_len: int | None = None,
                     tokenizer=None, top_logprobs: int = 0, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None) -> ResolvedRequest:
    """Resolve one request's settings. ``max_len``: the most tokens one request may hold (the
    cache's limit), which caps the default ``max_new_tokens``."""
    top_logprobs = _top_logprobs(top_logprobs)
    extra = openai_processors(presence_penalty, frequency_penalty, logit_bias, vocab_size=model.vocab_size,
                              device=model.device)
    kwargs = dict(kwargs)
    seed, key = kwargs.pop("seed", None), kwargs.pop("key", None)
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
    if eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
    config, unused = resolve_generation_config(model.generation_config, generation_config, kwargs)
    if unused:
        raise ValueError(f"add_request() got arguments that are not generation settings: {sorted(unused)}")
    bad = _unsupported(config)
    if bad:
        raise ValueError(f"continuous batching runs greedy search and sampling with logits processors; it does not "
                         f"support {', '.join(bad)}")
    prompt_len = len(prompt_ids)
    max_pos = model.max_position_embeddings
    if max_pos is not None and prompt_len >= max_pos:
        raise ValueError(f"the prompt has {prompt_len} tokens but the model's context (max_position_embeddings) "
                         f"is {max_pos}")
    max_length, min_length = resolve_lengths(config, prompt_len, max_pos)
    if max_len is not None and config.max_new_tokens is None:
        max_length = min(max_length, max_len)
    eos = config.eos_token_id
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    eos_ids = tuple(e for e in eos_ids if e >= 0)  # a negative id means none, as in transformers
    chain = build_logits_processors(config, prompt_len=prompt_len, max_length=max_length, min_length=min_length,
                                    eos_token_ids=list(eos_ids), num_beams=1, vocab_size=model.vocab_size,
                                    device=model.device, user_processors=extra)
    if chain.stateful:
        raise ValueError("a processor that keeps state across steps (SynthID watermarking) is not supported in "
                         "continuous batching")
    if chain.requires:
        raise ValueError(f"continuous batching does not support {sorted(dict(chain.requires))}")
    stop_strings = None
    if config.stop_strings is not None:
        stop_strings = _stop_matcher(tokenizer if tokenizer is not None else model.tokenizer, config.stop_strings,
                                     model.device)
    grammar = None
    if config.response_format is not None:
        if isinstance(config.response_format, (list, tuple)):
            raise ValueError("a request's response_format is one value (a dict), not a list")
        grammar = constraint_for_rows(tokenizer if tokenizer is not None else getattr(model, "tokenizer", None),
                                      [config.response_format], vocab_size=model.vocab_size, start=[prompt_len],
                                      eos_token_ids=eos_ids, engine=config.grammar_engine)
    settings = RequestSettings(
        chain=chain.per_row(1, model.device) if len(chain) else None,
        key=_key(seed, key) if config.do_sample else None,
        stop_strings=stop_strings,
        top_logprobs=top_logprobs,
        grammar=grammar,
    )
    return ResolvedRequest(settings, max(max_length - prompt_len, 1), eos_ids)
