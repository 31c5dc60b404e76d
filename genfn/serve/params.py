"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions`` -> validated sampling settings.

Pure functions of the parsed JSON: every field is checked for its type and range as OpenAI
documents it, an unknown field is refused (``APIError`` naming it), and a field left out (or
``null``) takes the server's default, which comes from the model's ``generation_config`` where it
sets one. ``manager_settings`` turns the result into the batching manager's keyword arguments.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from typing import Any

from genfn.serve.errors import bad_request

__all__ = ["DEFAULTS", "MAX_CHOICES", "MAX_STOP_STRINGS", "SamplingParams", "choice_seed", "defaults_from_config",
           "parse_chat", "parse_completion", "manager_settings"]

MAX_CHOICES = 64
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_LEGACY_LOGPROBS = 5

# OpenAI's defaults, used where the model's generation config does not set its own.
DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "max_tokens": None}

_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
                     "frequency_penalty", "logit_bias", "stream", "stream_options", "user", "top_k", "min_p",
                     "repetition_penalty"})
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}


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


# ---- field checks ------------------------------------------------------------------------------


def _get(body: Mapping, name: str) -> Any:
    return body.get(name)


def _int(body: Mapping, name: str, low: int | None = None, high: int | None = None) -> int | None:
    value = _get(body, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(name, f"'{name}' must be an integer, got {type(value).__name__} {value!r}",
                          code="invalid_type")
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad_request(name, f"'{name}' must be {_range(low, high)}, got {value}")
    return value


def _number(body: Mapping, name: str, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> float | None:
    value = _get(body, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(name, f"'{name}' must be a finite number, got {value!r}", code="invalid_type")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        lower = f"greater than {low}" if low_open else f"at least {low}"
        upper = f" and at most {high}" if high is not None else ""
        raise bad_request(name, f"'{name}' must be {lower}{upper}, got {value}")
    return float(value)


def _bool(body: Mapping, name: str) -> bool | None:
    value = _get(body, name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad_request(name, f"'{name}' must be a boolean, got {value!r}", code="invalid_type")
    return value


def _range(low, high) -> str:
    if high is None:
        return f"at least {low}"
    return f"between {low} and {high}"


def _stop(body: Mapping) -> tuple[str, ...]:
    value = _get(body, "stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("stop", "'stop' must be a string or a list of strings", code="invalid_type")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request("stop", f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    if any(not s for s in items):
        raise bad_request("stop", "'stop' strings must not be empty")
    return tuple(dict.fromkeys(items))


def _logit_bias(body: Mapping, vocab_size: int) -> dict[int, float]:
    value = _get(body, "logit_bias")
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise bad_request("logit_bias", "'logit_bias' must be an object mapping token ids to biases",
                          code="invalid_type")
    bias = {}
    for key, amount in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request("logit_bias", f"'logit_bias' keys must be token ids, got {key!r}") from None
        if not 0 <= token < vocab_size:
            raise bad_request("logit_bias", f"'logit_bias' token id {token} is outside the vocabulary "
                                            f"(0..{vocab_size - 1})")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not -100 <= amount <= 100:
            raise bad_request("logit_bias", f"'logit_bias' values must be numbers between -100 and 100, "
                                            f"got {amount!r} for token {token}")
        bias[token] = float(amount)
    return bias


def _refuse_unknown(body: Mapping, known: frozenset) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(unknown[0], f"Unrecognized request argument supplied: {', '.join(unknown)}",
                          code="unknown_parameter")


def _stream_options(body: Mapping, stream: bool) -> bool:
    options = _get(body, "stream_options")
    if options is None:
        return False
    if not isinstance(options, Mapping):
        raise bad_request("stream_options", "'stream_options' must be an object", code="invalid_type")
    if not stream:
        raise bad_request("stream_options", "'stream_options' is only allowed when 'stream' is true")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise bad_request("stream_options", f"Unrecognized stream option: {', '.join(unknown)}",
                          code="unknown_parameter")
    return bool(_bool(options, "include_usage"))


def _model(body: Mapping) -> str | None:
    value = _get(body, "model")
    if value is not None and not isinstance(value, str):
        raise bad_request("model", f"'model' must be a string, got {value!r}", code="invalid_type")
    return value


def _common(body: Mapping, defaults: Mapping, vocab_size: int, max_tokens: int | None) -> dict:
    def pick(name, value):
        return value if value is not None else defaults.get(name, DEFAULTS[name])

    stream = bool(_bool(body, "stream"))
    return dict(
        model=_model(body),
        n=_int(body, "n", 1, MAX_CHOICES) or 1,
        max_tokens=max_tokens if max_tokens is not None else defaults.get("max_tokens"),
        temperature=pick("temperature", _number(body, "temperature", 0.0, 2.0)),
        top_p=pick("top_p", _number(body, "top_p", 0.0, 1.0, low_open=True)),
        top_k=pick("top_k", _top_k(body)),
        min_p=pick("min_p", _number(body, "min_p", 0.0, 1.0)),
        repetition_penalty=pick("repetition_penalty", _number(body, "repetition_penalty", 0.0, low_open=True)),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        logit_bias=_logit_bias(body, vocab_size),
        stop=_stop(body),
        seed=_int(body, "seed"),
        stream=stream,
        include_usage=_stream_options(body, stream),
    )


def _top_k(body: Mapping) -> int | None:
    value = _int(body, "top_k", -1)
    return 0 if value == -1 else value  # -1 is vLLM's spelling of "no top-k"


def _max_tokens(body: Mapping, name: str) -> int | None:
    return _int(body, name, 1)


# ---- the two endpoints ---------------------------------------------------------------------------


def parse_completion(body: Mapping, defaults: Mapping, vocab_size: int) -> tuple[SamplingParams, Any]:
    """``/v1/completions``: the settings and the raw ``prompt`` (checked by the app when it tokenizes)."""
    _refuse_unknown(body, COMPLETION_FIELDS)
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt", "'prompt' is required", code="missing_required_parameter")
    if _bool(body, "echo"):
        raise bad_request("echo", "'echo' is not supported by this server")
    if _get(body, "suffix") is not None:
        raise bad_request("suffix", "'suffix' is not supported by this server")
    common = _common(body, defaults, vocab_size, _max_tokens(body, "max_tokens"))
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != common["n"]:
        raise bad_request("best_of", "'best_of' other than 'n' is not supported by this server")
    logprobs = _int(body, "logprobs", 0, MAX_LEGACY_LOGPROBS)
    return SamplingParams(**common, top_logprobs=logprobs), body["prompt"]


def parse_chat(body: Mapping, defaults: Mapping, vocab_size: int) -> tuple[SamplingParams, list]:
    """``/v1/chat/completions``: the settings and the messages as plain ``{"role", "content"}`` dicts."""
    _refuse_unknown(body, CHAT_FIELDS)
    messages = _messages(body)
    legacy, current = _max_tokens(body, "max_tokens"), _max_tokens(body, "max_completion_tokens")
    if legacy is not None and current is not None and legacy != current:
        raise bad_request("max_completion_tokens", "give 'max_completion_tokens' or 'max_tokens', not both")
    common = _common(body, defaults, vocab_size, current if current is not None else legacy)
    logprobs = bool(_bool(body, "logprobs"))
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise bad_request("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    return SamplingParams(**common, top_logprobs=(top or 0) if logprobs else None), messages


def _messages(body: Mapping) -> list[dict]:
    messages = _get(body, "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "'messages' must be a non-empty list of messages",
                          code="invalid_type" if messages is not None else "missing_required_parameter")
    plain = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise bad_request(where, f"'{where}' must be an object with 'role' and 'content'", code="invalid_type")
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad_request(f"{where}.role", f"'{where}.role' must be one of 'system', 'developer', 'user', "
                                               f"'assistant', got {role!r}")
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise bad_request(f"{where}.{unknown[0]}", f"Unrecognized message field: {', '.join(unknown)}",
                              code="unknown_parameter")
        plain.append({"role": "system" if role == "developer" else role,
                      "content": _content(message.get("content"), f"{where}.content")})
    return plain


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(where, f"'{where}' parts must be {{'type': 'text', 'text': str}}; this server "
                                         f"reads text only")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(where, f"'{where}' must be a string or a list of text parts", code="invalid_type")


# ---- to the manager ---------------------------------------------------------------------------------


def defaults_from_config(generation_config) -> dict:
    """The sampling defaults a model's ``generation_config`` sets (fields it leaves unset are left out)."""
    if generation_config is None:
        return {}
    found = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(generation_config, name, None)
        if value is not None:
            found[name] = value
    if getattr(generation_config, "max_new_tokens", None) is not None:
        found["max_tokens"] = generation_config.max_new_tokens
    return found


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``: choice 0 keeps the request's
    seed (so ``n=1`` and the first of ``n>1`` agree), the others get independent ones."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def manager_settings(params: SamplingParams, max_new_tokens: int, index: int) -> dict:
    """``add_request`` keyword arguments for choice ``index`` (settings left at their neutral value
    are not passed, so they select no processor)."""
    settings: dict = {"max_new_tokens": max_new_tokens}
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
    return settings
