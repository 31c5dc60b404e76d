"""The sampling defaults a request gets for the settings it leaves out: one rule for the web page,
the API and ``genfn chat``.

``auto`` (the default) takes the sampling settings the model's ``generation_config.json`` sets,
as vLLM's ``generation_config="auto"`` does; a model that sets none (a GGUF file, a config without
them) gets ``CHAT_DEFAULTS`` (temperature 0.7, top-p 0.95, top-k 50), the values small chat models
write sensible text with. ``none`` sets nothing (a request that sets nothing gets OpenAI's
defaults: temperature 1, top-p 1). ``temperature=0.7,top_p=0.9`` overrides those keys of ``auto``.
Pure functions, no web dependency: the CLI uses them without the ``serve`` extra.
"""

from __future__ import annotations

import math

__all__ = ["CHAT_DEFAULTS", "SETTINGS", "defaults_from_config", "parse_sampling_defaults", "sampling_defaults"]

CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.95, "top_k": 50}
# key -> (type, low, high): the settings a default may set.
SETTINGS = {"temperature": (float, 0.0, 2.0), "top_p": (float, 0.0, 1.0), "top_k": (int, 0, None),
            "min_p": (float, 0.0, 1.0), "repetition_penalty": (float, 0.0, None), "max_tokens": (int, 1, None)}
_SAMPLING = ("temperature", "top_p", "top_k", "min_p")


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


def parse_sampling_defaults(text: str) -> str | dict:
    """``--sampling-defaults``: ``auto``, ``none`` or ``key=value,...``; a ValueError naming what is wrong."""
    if not isinstance(text, str):
        raise TypeError(f"sampling defaults must be a string, got {type(text).__name__}")
    spec = text.strip()
    if spec.lower() in ("auto", "none"):
        return spec.lower()
    values = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in SETTINGS:
            raise ValueError(f"sampling defaults are 'auto', 'none' or key=value pairs with the keys "
                             f"{', '.join(SETTINGS)}; got {item!r}")
        kind, low, high = SETTINGS[key]
        try:
            value = kind(raw.strip())
        except ValueError:
            raise ValueError(f"sampling default {key} must be {'an integer' if kind is int else 'a number'}, "
                             f"got {raw.strip()!r}") from None
        if (kind is float and not math.isfinite(value)) or value < low or (high is not None and value > high):
            bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise ValueError(f"sampling default {key} must be {bounds}, got {raw.strip()}")
        values[key] = value
    if not values:
        raise ValueError("sampling defaults are 'auto', 'none' or key=value pairs, got an empty text")
    return values


def sampling_defaults(generation_config, spec: str | dict = "auto") -> dict:
    """The defaults for ``spec`` (see the module's text) over a model's ``generation_config``."""
    if isinstance(spec, str):
        spec = parse_sampling_defaults(spec)
    if spec == "none":
        return {}
    model = defaults_from_config(generation_config)
    base = model if any(name in model for name in _SAMPLING) else {**CHAT_DEFAULTS, **model}
    return base if spec == "auto" else {**base, **spec}
