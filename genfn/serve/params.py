"""Validated request bodies (``schemas``) -> one request's sampling settings -> the manager's arguments.

``chat_params`` / ``completion_params`` fill what a request leaves out from the server's defaults
(``defaults.sampling_defaults``) and check what needs the model (token ids against the
vocabulary); ``manager_settings`` turns the result into ``add_request`` keyword arguments for one
choice. ``parse_chat`` / ``parse_completion`` do both steps from a plain dict (tests, scripts).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from genfn.serve.defaults import defaults_from_config
from genfn.serve.errors import bad_request, validation_error
from genfn.serve.schemas import (MAX_CHOICES, MAX_LEGACY_LOGPROBS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS,
                                 ChatCompletionRequest, CompletionRequest)

__all__ = ["DEFAULTS", "MAX_CHOICES", "MAX_STOP_STRINGS", "MAX_TOP_LOGPROBS", "MAX_LEGACY_LOGPROBS", "SamplingParams",
           "choice_seed", "defaults_from_config", "chat_params", "completion_params", "parse_chat",
           "parse_completion", "plain_messages", "manager_settings"]

# OpenAI's defaults, for what neither the request nor the server's defaults set.
DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "max_tokens": None}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's settings, validated. ``max_tokens`` ``None``: as many as the context leaves.
    ``top_logprobs`` ``None``: no logprobs; ``0..20``: logprobs with that many alternatives."""

    model: str | None
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = dataclasses.field(default_factory=dict)
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None
    num_beams: int = 1  # > 1: beam search; the n choices of a prompt are its n best hypotheses
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    prompt_lookup_num_tokens: int | None = None


def _logit_bias(bias: Mapping[str, float] | None, vocab_size: int) -> dict[int, float]:
    checked = {}
    for key, amount in (bias or {}).items():
        token = int(key)
        if not 0 <= token < vocab_size:
            raise bad_request("logit_bias", f"'logit_bias' token id {token} is outside the vocabulary "
                                            f"(0..{vocab_size - 1})")
        checked[token] = float(amount)
    return checked


def _common(request, defaults: Mapping, vocab_size: int, max_tokens: int | None) -> dict:
    def pick(name):
        value = getattr(request, name)
        return value if value is not None else defaults.get(name, DEFAULTS[name])

    stop = request.stop
    stop = () if stop is None else tuple(dict.fromkeys([stop] if isinstance(stop, str) else stop))
    top_k = pick("top_k")
    return dict(
        model=request.model,
        n=request.n or 1,
        max_tokens=max_tokens if max_tokens is not None else defaults.get("max_tokens"),
        temperature=float(pick("temperature")),
        top_p=float(pick("top_p")),
        top_k=0 if top_k == -1 else int(top_k),  # -1 is vLLM's spelling of "no top-k"
        min_p=float(pick("min_p")),
        repetition_penalty=float(pick("repetition_penalty")),
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        logit_bias=_logit_bias(request.logit_bias, vocab_size),
        stop=stop,
        seed=request.seed,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        num_beams=request.num_beams or 1,
        length_penalty=None if request.length_penalty is None else float(request.length_penalty),
        early_stopping=request.early_stopping,
        prompt_lookup_num_tokens=request.prompt_lookup_num_tokens,
    )


def completion_params(request: CompletionRequest, defaults: Mapping, vocab_size: int) -> SamplingParams:
    return SamplingParams(**_common(request, defaults, vocab_size, request.max_tokens), top_logprobs=request.logprobs)


def chat_params(request: ChatCompletionRequest, defaults: Mapping, vocab_size: int) -> SamplingParams:
    limit, _ = request.completion_limit
    top = (request.top_logprobs or 0) if request.logprobs else None
    return SamplingParams(**_common(request, defaults, vocab_size, limit), top_logprobs=top)


def plain_messages(request: ChatCompletionRequest) -> list[dict]:
    """The messages as a chat template reads them: ``developer`` becomes ``system``, text parts are
    joined, an assistant's tool calls and a tool's answer keep their fields."""
    plain = []
    for message in request.messages:
        item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                "content": message.text()}
        if message.tool_calls:
            item["tool_calls"] = [{"id": call.id, "type": "function",
                                   "function": {"name": call.function.name, "arguments": call.function.arguments}}
                                  for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            item["name"] = message.name
        plain.append(item)
    return plain


def _validate(model, body: Mapping):
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def parse_completion(body: Mapping, defaults: Mapping, vocab_size: int) -> tuple[SamplingParams, Any]:
    """``/v1/completions`` from a dict: the settings and the raw ``prompt`` (tokenized by the app)."""
    request = _validate(CompletionRequest, body)
    return completion_params(request, defaults, vocab_size), request.prompt


def parse_chat(body: Mapping, defaults: Mapping, vocab_size: int) -> tuple[SamplingParams, list]:
    """``/v1/chat/completions`` from a dict: the settings and the messages as plain dicts."""
    request = _validate(ChatCompletionRequest, body)
    return chat_params(request, defaults, vocab_size), plain_messages(request)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``: choice 0 keeps the request's
    seed (so ``n=1`` and the first of ``n>1`` agree), the others get independent ones."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def manager_settings(params: SamplingParams, max_new_tokens: int, index: int) -> dict:
    """``add_request`` keyword arguments for choice ``index`` (settings left at their neutral value
    are not passed, so they select no processor). A beam request (``num_beams > 1``) is one manager
    request for all ``n`` choices of its prompt (``index`` 0): its ``n`` best hypotheses."""
    settings: dict = {"max_new_tokens": max_new_tokens}
    if params.num_beams > 1:
        settings.update(num_beams=params.num_beams, num_return_sequences=params.n)
        for name in ("length_penalty", "early_stopping"):
            if getattr(params, name) is not None:
                settings[name] = getattr(params, name)
    if params.temperature > 0:
        settings.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        if params.min_p > 0:
            settings["min_p"] = params.min_p
    else:
        settings["do_sample"] = False
    if params.repetition_penalty != 1.0:
        settings["repetition_penalty"] = params.repetition_penalty
    if params.presence_penalty:
        settings["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        settings["frequency_penalty"] = params.frequency_penalty
    if params.logit_bias:
        settings["logit_bias"] = dict(params.logit_bias)
    if params.top_logprobs:
        settings["top_logprobs"] = params.top_logprobs
    if params.stop:
        settings["stop_strings"] = list(params.stop)
    if params.seed is not None:
        settings["seed"] = choice_seed(params.seed, index)
    if params.prompt_lookup_num_tokens is not None:
        settings["prompt_lookup_num_tokens"] = params.prompt_lookup_num_tokens
    return settings
