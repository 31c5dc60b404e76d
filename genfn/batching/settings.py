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

from genfn.batching import guidance_groups as GG
from genfn.batching.drafting import DraftRounds
from genfn.batching.engine import RequestSettings
from genfn.batching.ranks import tensor_parallel_shard
from genfn.batching.requests import RequestState, make_request
from genfn.batching.speculation import Speculation
from genfn.batching.row_state import RowCarry
from genfn.config import GenerationConfig
from genfn.generation import generate
from genfn.processors.openai_sampling import openai_processors
from genfn.resolve import request_key, resolve_request
from genfn.state.beam import BeamState
from genfn.strategies.assisted.block import BlockDrafter
from genfn.strategies.assisted.build import carried_schedules, drafter_for
from genfn.strategies.assisted.drafter import PromptLookupDrafter
from genfn.strategies.assisted.early_exit import EarlyExitDrafter
from genfn.strategies.assisted.schedule import schedule_for_next_call
from genfn.strategies.beam import initial_state
from genfn.structured.rows import constraint_for_rows

__all__ = ["MAX_TOP_LOGPROBS", "ResolvedRequest", "request_settings", "sequence_requests"]

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for `top_logprobs`

# Settings that need a model-level feature continuous batching does not run (contrastive search's
# look-ahead; MTP heads, which read the target's hidden states that the packed forward does not
# return). Beam search (genfn.batching.beam_groups), speculation with prompt lookup, a draft model or
# early exit (genfn.batching.speculation, genfn.batching.drafting), classifier-free guidance,
# watermarking (SynthID's state included) and token healing run: see genfn.batching.row_state and
# request_settings.
_UNSUPPORTED = {"penalty_alpha": None, "use_mtp": False}


@dataclasses.dataclass(frozen=True)
class ResolvedRequest:
    """A request's settings; ``sequences``: the settings of each of its ``num_return_sequences``
    sequences (the first is ``settings``), which differ only in their keys. ``beam``: a beam
    request's beam buffers before its first step (``num_beams > 1``; its sequences are then its
    returned hypotheses, which run as one beam group). ``prompt_ids``: the prompt the request runs
    (under ``token_healing``, the healed one, as ``generate`` runs it). ``unconditional``: under
    classifier-free guidance, each sequence's unconditional input (``genfn.batching.guidance_groups``)."""

    settings: RequestSettings
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    sequences: tuple[RequestSettings, ...] = ()
    beam: BeamState | None = None
    prompt_ids: tuple[int, ...] = ()
    unconditional: tuple[int, ...] | None = None


# A guided request's unconditional request: no processors, no key, never failed on its own logits.
_UNCONDITIONAL = RequestSettings(check_finite=False)


def sequence_requests(ids, resolved: ResolvedRequest) -> list[RequestState]:
    """The requests of a resolved (not beam) request's sequences, under ``ids``; a guided one
    carrying its unconditional request (``guidance_groups.with_partner``)."""
    requests = []
    for request_id, settings in zip(ids, resolved.sequences):
        request = make_request(request_id, resolved.prompt_ids, resolved.max_new_tokens,
                               list(resolved.eos_token_ids), {"genfn": settings})
        if resolved.unconditional is not None:
            request = GG.with_partner(request, resolved.unconditional, {"genfn": _UNCONDITIONAL})
        requests.append(request)
    return requests


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
        raise ValueError(f"continuous batching runs greedy search, sampling and beam search with logits processors, "
                         f"and speculation (prompt_lookup_num_tokens, assistant_model, assistant_early_exit); it "
                         f"does not support {', '.join(found)} (run it with genfn.generate)")


def _check_assistant(model, assistant_model) -> None:
    if not all(hasattr(assistant_model, name) for name in ("apply", "init_cache", "vocab_size")):
        raise TypeError(f"assistant_model must be a genfn Model sharing the model's tokenizer (load it with "
                        f"genfn.load), got {type(assistant_model).__name__}")
    if assistant_model.vocab_size != model.vocab_size:
        raise ValueError(f"assistant_model has a vocabulary of {assistant_model.vocab_size} tokens and the model "
                         f"{model.vocab_size}: continuous batching drafts with an assistant that shares the model's "
                         f"tokenizer (an assistant with another tokenizer runs in genfn.generate, with "
                         f"assistant_tokenizer=)")


def _speculation(model, request, assistant_model):
    """``make() -> Speculation`` for each sequence (None: the request does not speculate), with the
    drafter ``generate`` builds for the same settings (``genfn.strategies.assisted.build``): prompt
    lookup (one value for every sequence), or a model drafter, which keeps a round per sequence."""
    config = request.config
    if config.prompt_lookup_num_tokens is None and config.assistant_early_exit is None and assistant_model is None:
        return None
    if config.guidance_scale not in (None, 1.0) or config.watermarking_config is not None:
        raise ValueError("speculation (prompt_lookup_num_tokens, assistant_model, assistant_early_exit) with "
                         "guidance_scale or watermarking_config is not supported (nor in generate's assisted "
                         "decoding); drop one of them")
    if config.speculation_type == "dflash" or isinstance(assistant_model, BlockDrafter):
        raise ValueError("a block drafter (speculation_type='dflash') reads the target's hidden states, which "
                         "continuous batching's packed forward does not return; run it with genfn.generate")
    if assistant_model is not None and config.assistant_early_exit is None and config.prompt_lookup_num_tokens is None:
        _check_assistant(model, assistant_model)
    drafter, owner = drafter_for(model, request, assistant_model)
    if isinstance(drafter, PromptLookupDrafter):
        if config.assistant_ensemble_weight is not None:
            raise ValueError("assistant_ensemble_weight needs a draft model's probabilities, and prompt lookup gives "
                             "none (prompt_lookup_num_tokens); drop assistant_ensemble_weight")
        lookup = Speculation(drafter)
        return lambda: lookup
    if isinstance(drafter, EarlyExitDrafter):
        drafter.prefill(model, request)  # its checks: the model's layers as functions, the exit below the last
    kind = config.num_assistant_tokens_schedule or "constant"
    weight = config.assistant_ensemble_weight

    def make() -> Speculation:
        schedule = None
        if owner is not None and kind != "constant":  # generate's schedule, carried across calls
            schedule = schedule_for_next_call(carried_schedules.get(owner), drafter.num_tokens, 1, kind, model.device)
        return Speculation(rounds=DraftRounds(drafter, request, schedule, owner,
                                              None if weight is None else float(weight)))

    return make


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
    assistant_model = kwargs.pop("assistant_model", None)
    key = request_key(kwargs.pop("seed", None), kwargs.pop("key", None))
    # generate takes the negative prompt as arguments of its own, not as config settings
    negative = {name: kwargs.pop(name, None) for name in ("negative_prompt_ids", "negative_prompt_attention_mask")}
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
    if eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
    prompt = torch.as_tensor([list(prompt_ids)], dtype=torch.int64, device=model.device)
    beams = _num_beams(model, generation_config, kwargs)
    while True:
        # A beam request's rows are its beams, expanded as generate expands them (the chain and the
        # beam buffers have num_beams rows); resolved again if the merged config says otherwise.
        request = resolve_request(model, prompt, generation_config, kwargs, key=key,
                                  attention_mask=torch.ones_like(prompt), logits_processor=extra or None,
                                  tokenizer=tokenizer if tokenizer is not None else model.tokenizer, paged=True,
                                  length_cap=max_len, check_config=_refuse_unsupported, expand_rows=beams > 1,
                                  heal=generate, caller="add_request()", assistant_model=assistant_model,
                                  **negative).request
        if int(request.config.num_beams or 1) == beams:
            break
        beams = int(request.config.num_beams or 1)
    if tensor_parallel_shard(model) is not None and (request.config.assistant_early_exit is not None or (
            assistant_model is not None and tensor_parallel_shard(assistant_model) is not None)):
        # rank 0 drafts alone, beside the batch: a drafter over sharded layers would wait in their
        # collectives for ranks that never call them
        raise ValueError("under tensor parallelism, continuous batching drafts on rank 0 alone: assistant_early_exit "
                         "and a sharded assistant_model are refused; use an unsharded assistant_model or "
                         "prompt_lookup_num_tokens")
    # A healed prompt is one row without padding (genfn.healing re-pads rows to the batch's widest).
    prompt = tuple(request.input_ids[0][request.attention_mask[0].bool()].tolist())
    if beams > 1:
        return _beam_request(request, top_logprobs, prompt)
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
    speculation = _speculation(model, request, assistant_model)
    sequences = tuple(RequestSettings(chain=chain, key=request.keys[j] if request.keys is not None else None,
                                      stop_strings=request.stop_strings, top_logprobs=top_logprobs,
                                      check_finite=not bool(config.remove_invalid_values), grammar=grammar(),
                                      speculation=speculation() if speculation is not None else None,
                                      carry=_carry(chain, request.guidance))
                      for j in range(count))
    unconditional = None if request.guidance is None else GG.unconditional_ids(request.guidance, prompt)
    return ResolvedRequest(sequences[0], max(request.max_length - request.prompt_len, 1), request.eos_token_ids,
                           sequences, prompt_ids=prompt, unconditional=unconditional)


def _num_beams(model, generation_config, kwargs) -> int:
    # The merged value as resolve_request merges it (kwargs > the config passed > the model's), read
    # before resolving, so the request is resolved once in the common case.
    for source in (kwargs, generation_config, getattr(model, "generation_config", None)):
        value = source.get("num_beams") if isinstance(source, dict) else getattr(source, "num_beams", None)
        if value is not None:
            return int(value)
    return 1


def _beam_request(request, top_logprobs: int, prompt: tuple[int, ...]) -> ResolvedRequest:
    """A beam request: its prompt rows expanded ``num_beams`` times (as ``generate`` runs them),
    its beam buffers, and one sequence per returned hypothesis."""
    config = request.config
    refused = [name for name, on in (("stop_strings", request.stop_strings is not None),
                                     ("response_format", config.response_format is not None),
                                     ("guidance_scale", request.guidance is not None),
                                     ("top_logprobs", top_logprobs > 0)) if on]
    if refused:
        raise ValueError(f"beam search in continuous batching does not support {', '.join(refused)} (as "
                         f"generate's beam search does not); use greedy search or sampling for them")
    beam = initial_state(request)
    # The group checks its logits itself (a beam step ends the whole group), so its rows are not
    # failed one by one.
    settings = RequestSettings(check_finite=False)
    count = beam.options.num_return_sequences
    return ResolvedRequest(settings, max(request.max_length - request.prompt_len, 1), request.eos_token_ids,
                           (settings,) * count, beam, prompt)


def _carry(chain, guidance) -> RowCarry | None:
    """A sequence's own state box when its settings keep state across steps (one per sequence)."""
    if guidance is None and (chain is None or not chain.stateful):
        return None
    return RowCarry(guidance=guidance)
