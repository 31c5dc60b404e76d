"""The ``config.json`` fields every decoder family (Llama, Gemma, GPT-OSS) reads alike.

Each family's ``spec_from_config`` reads its own switches and defaults; the sizes that fix the
tensor shapes, which layers attend within the sliding window, and the head-grouping check are read
here, so that a missing field or a bad head count is refused in the same words by every family.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["required_field", "decoder_sizes", "sliding_layers", "check_head_groups"]


def required_field(config: Mapping[str, Any], name: str) -> Any:
    """``config[name]``, or a ValueError naming the missing field."""
    try:
        return config[name]
    except KeyError:
        raise ValueError(f"config.json is missing the required field {name!r}") from None


def decoder_sizes(config: Mapping[str, Any]) -> dict[str, int]:
    """The spec fields ``vocab_size, hidden_size, intermediate_size, num_layers, num_heads,
    num_kv_heads, head_dim``, with transformers' defaults (as many kv heads as query heads, and
    ``hidden_size // num_attention_heads`` per head)."""
    hidden = int(required_field(config, "hidden_size"))
    heads = int(required_field(config, "num_attention_heads"))
    return dict(
        vocab_size=int(required_field(config, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(required_field(config, "intermediate_size")),
        num_layers=int(required_field(config, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
    )


def sliding_layers(config: Mapping[str, Any], num_layers: int, full_every: int) -> tuple[bool, ...]:
    """Per layer, whether it attends within the sliding window: from the config's ``layer_types``,
    or, where it has none, every ``full_every``-th layer full and the others sliding (transformers'
    default pattern)."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % full_every else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return tuple(kind == "sliding_attention" for kind in layer_types)


def check_head_groups(spec) -> None:
    """Refuse a spec whose query heads do not split evenly over its kv heads."""
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"num_attention_heads ({spec.num_heads}) must be a multiple of "
                         f"num_key_value_heads ({spec.num_kv_heads})")
