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

import dataclasses

import torch

from genfn.batching.engine import RequestSettings
from genfn.batching.row_state import RowCarry
from genfn.config import GenerationConfig
from genfn.generation import generate
from genfn.processors.openai_sampling import openai_processors
from genfn.resolve import request_key, resolve_request
from genfn.structured.rows import constraint_for_rows

__all__ = ["MAX_TOP_LOGPROBS", "ResolvedRequest", "request_settings"]

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for `top_logprobs`

# Settings that need a model-level feature continuous batching does not run (several hypotheses
# per request, or several tokens per step). Classifier-free guidance, watermarking (SynthID's
# state included) and token healing run: see genfn.batching.row_state and request_settings.
_UNSUPPORTED = {"num_beams": 1, "penalty_alpha": None, "assistant_model": None,
                "prompt_lookup_num_tokens": None}


@dataclasses.dataclass(frozen=True)
class ResolvedRequest:
    """A request's settings; ``sequences``: the settings of each of its ``num_return_sequences``
    sequences (the first is ``settings``), which differ only in their keys. ``prompt_ids``: the
    prompt the request runs (under ``token_healing``, the healed one, as ``generate`` runs it)."""

    settings: RequestSettings
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    sequences: tuple[RequestSettings, ...] = ()
    prompt_ids: tuple[int, ...] = ()


def _top_logprobs(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`top_logprobs` must be an int in [0, {MAX_TOP_LOGPROBS}], got {type(value).__name__}")
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"`top_logprobs` must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
    return value


def _refuse_unsupported(config: GenerationConfig) -> None:
    found = []
    for name, off in _UNSUPPORTED.items():
        value = getattr(config, name, off)
        if value is not None and value != off:
            found.append(f"{name}={value!r}")
    if found:
        raise ValueError(f"continuous batching runs greedy search and sampling with logits processors; it does not "
                         f"support {', '.join(found)}")


def request_settings(model, prompt_ids, generation_config: GenerationConfig | None, kwargs: dict, *,
                     max_new_tokens: int | None = None, eos_token_id=None, max_len: int | None = None,
                     tokenizer=None, top_logprobs: int = 0, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None) -> ResolvedRequest:
    """Resolve one request's settings with ``genfn.resolve.resolve_request`` (what ``generate``
    runs) on its one prompt row. ``max_len``: the most tokens one request may hold (the cache's
    limit), which caps the default ``max_new_tokens``."""
    top_logprobs = _top_logprobs(top_logprobs)
    extra = openai_processors(presence_penalty, frequency_penalty, logit_bias, vocab_size=model.vocab_size,
                              device=model.device)
    kwargs = dict(kwargs)
    key = request_key(kwargs.pop("seed", None), kwargs.pop("key", None))
    # generate takes the negative prompt as arguments of its own, not as config settings
    negative = {name: kwargs.pop(name, None) for name in ("negative_prompt_ids", "negative_prompt_attention_mask")}
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
    if eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
    prompt = torch.as_tensor([list(prompt_ids)], dtype=torch.int64, device=model.device)
    request = resolve_request(model, prompt, generation_config, kwargs, key=key,
                              attention_mask=torch.ones_like(prompt), logits_processor=extra or None,
                              tokenizer=tokenizer if tokenizer is not None else model.tokenizer, paged=True,
                              length_cap=max_len, check_config=_refuse_unsupported, expand_rows=False,
                              heal=generate, caller="add_request()", **negative).request
    chain = request.processors
    config = request.config
    if config.response_format is not None and isinstance(config.response_format, (list, tuple)):
        raise ValueError("a request's response_format is one value (a dict), not a list")

    def grammar():
        # Each sequence gets a matcher of its own: a matcher follows one sequence's tokens.
        if config.response_format is None:
            return None
        return constraint_for_rows(tokenizer if tokenizer is not None else getattr(model, "tokenizer", None),
                                   [config.response_format], vocab_size=model.vocab_size,
                                   start=[request.prompt_len], eos_token_ids=request.eos_token_ids,
                                   engine=config.grammar_engine)

    # Sequence j of a request samples with the key generate gives the prompt's j-th returned row.
    count = int(config.num_return_sequences or 1)
    sequences = tuple(RequestSettings(chain=chain, key=request.keys[j] if request.keys is not None else None,
                                      stop_strings=request.stop_strings, top_logprobs=top_logprobs,
                                      check_finite=not bool(config.remove_invalid_values), grammar=grammar(),
                                      carry=_carry(chain, request.guidance))
                      for j in range(count))
    # A healed prompt is one row without padding (genfn.healing re-pads rows to the batch's widest).
    prompt = tuple(request.input_ids[0][request.attention_mask[0].bool()].tolist())
    return ResolvedRequest(sequences[0], max(request.max_length - request.prompt_len, 1), request.eos_token_ids,
                           sequences, prompt)


def _carry(chain, guidance) -> RowCarry | None:
    """A sequence's own state box when its settings keep state across steps (one per sequence)."""
    if guidance is None and (chain is None or not chain.stateful):
        return None
    return RowCarry(guidance=guidance)
