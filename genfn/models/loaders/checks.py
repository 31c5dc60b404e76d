"""Every weight checked against the config before the model code sees it.

A tensor of the wrong shape would otherwise surface as a matmul error deep inside the first
forward pass (or, worse, broadcast silently); an integer tensor would be cast to float and give
garbage. Both are refused at load time, naming the tensor, its shape or dtype, and what the
config implies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .errors import LLAMA_FAMILY, CheckpointError

__all__ = ["expected_shapes", "check_tensors", "check_gguf_tensors", "check_quantization_config", "FLOAT_DTYPES"]

# Dtypes a weight may be stored in: the model casts them to the requested float dtype exactly.
# float8 is not among them: its values mean nothing without the scales a quantization keeps.
FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})


def _dims(config: Any) -> dict[str, Any]:
    """The sizes that fix the tensor shapes, from a config.json dict or a model spec object."""
    def get(*names, default=None):
        for name in names:
            value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
            if value is not None:
                return value
        return default

    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads", "num_heads"))
    return dict(
        vocab=int(get("vocab_size")),
        hidden=hidden,
        intermediate=int(get("intermediate_size")),
        layers=int(get("num_hidden_layers", "num_layers")),
        heads=heads,
        kv_heads=int(get("num_key_value_heads", "num_kv_heads", default=heads)),
        head_dim=int(get("head_dim", default=hidden // heads)),
        tied=bool(get("tie_word_embeddings", default=False)),
        bias=bool(get("attention_bias", default=False)),
        # OLMo 2 norms the whole q/k projection, Qwen3 each head.
        qk_norm_whole=get("qk_norm") == "projection" or get("model_type") == "olmo2",
    )


def expected_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter name -> shape, for a llama-family config (dict or spec).

    Optional tensors (qkv biases of a model without ``attention_bias``, Qwen3's q/k norms) are
    listed too, so that a wrong one is caught when it is present.
    """
    d = _dims(config)
    q_rows, kv_rows = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    shapes = {
        "model.embed_tokens.weight": (d["vocab"], d["hidden"]),
        "model.norm.weight": (d["hidden"],),
        "lm_head.weight": (d["vocab"], d["hidden"]),
    }
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q_rows, d["hidden"]),
            p + "self_attn.k_proj.weight": (kv_rows, d["hidden"]),
            p + "self_attn.v_proj.weight": (kv_rows, d["hidden"]),
            p + "self_attn.o_proj.weight": (d["hidden"], q_rows),
            p + "self_attn.q_proj.bias": (q_rows,),
            p + "self_attn.k_proj.bias": (kv_rows,),
            p + "self_attn.v_proj.bias": (kv_rows,),
            p + "self_attn.q_norm.weight": (q_rows,) if d["qk_norm_whole"] else (d["head_dim"],),
            p + "self_attn.k_norm.weight": (kv_rows,) if d["qk_norm_whole"] else (d["head_dim"],),
            p + "self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, d["hidden"]),
            p + "mlp.gate_up_proj.weight": (2 * d["intermediate"], d["hidden"]),
            p + "post_feedforward_layernorm.weight": (d["hidden"],),
            p + "mlp.gate_proj.weight": (d["intermediate"], d["hidden"]),
            p + "mlp.up_proj.weight": (d["intermediate"], d["hidden"]),
            p + "mlp.down_proj.weight": (d["hidden"], d["intermediate"]),
            p + "input_layernorm.weight": (d["hidden"],),
            p + "post_attention_layernorm.weight": (d["hidden"],),
        })
    return shapes


def check_quantization_config(config: Mapping, source: str) -> None:
    """A Hugging Face checkpoint saved by a quantizer (GPTQ, AWQ, bitsandbytes, fp8, ...) stores
    codes and scales under its own names; genfn cannot read them as plain weights."""
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, Mapping) else "unknown"
        raise CheckpointError(
            f"{source}: config.json declares quantization_config (quant_method={method!r}); genfn loads "
            "Hugging Face checkpoints with floating-point weights only (quantized weights load from GGUF files: "
            "Q8_0, Q4_0, Q4_1)")


def check_tensors(state_dict: Mapping[str, Any], config: Any, source: str) -> None:
    """Raise CheckpointError for a weight whose dtype is not floating point, or naming the first
    weight (in model order) whose shape disagrees with ``config``. ``config`` is a config.json dict or a model spec.

    A value that is not a plain tensor (a quantized weight of a known format) is checked by its
    logical ``shape`` only, when it has one.
    """
    family = config.get("model_type") if isinstance(config, Mapping) else None
    if isinstance(config, Mapping):
        check_quantization_config(config, source)
        if family is not None and family not in LLAMA_FAMILY:
            return
    shapes = expected_shapes(config)
    wrong = []
    for name, expected in shapes.items():  # model order, so the first error named is the earliest weight
        value = state_dict.get(name)
        if value is None:
            continue
        if isinstance(value, torch.Tensor) and value.dtype not in FLOAT_DTYPES:
            kind = "integer" if not value.dtype.is_floating_point else "scaled float8"
            raise CheckpointError(
                f"{source}: tensor {name} holds {kind} values ({value.dtype}) that are not a known quantization; "
                "genfn loads floating-point weights (float32, float16, bfloat16) and GGUF's quantized blocks")
        shape = getattr(value, "shape", None)
        if shape is not None and tuple(shape) != expected:
            wrong.append((name, list(shape), list(expected)))
    if wrong:
        name, shape, expected = wrong[0]
        more = f"; {len(wrong)} tensors disagree in all" if len(wrong) > 1 else ""
        raise CheckpointError(f"{source}: tensor {name} has shape {shape}, but the config implies {expected} "
                              f"({_explain(name, config)}){more}")


# ggml's plain integer types: a llama-family GGUF stores no weight as integers unless in blocks.
_GGML_INTEGER_TYPES = frozenset({"I8", "I16", "I32", "I64"})


def check_gguf_tensors(gguf_file: Any, state_dict: Mapping[str, Any], config: Mapping) -> None:
    """:func:`check_tensors` for a GGUF file's state dict, after refusing weights stored as plain
    ggml integers (the reader would turn them into floats, silently)."""
    from gguf import GGMLQuantizationType

    for name, info in gguf_file.tensors.items():
        kind = GGMLQuantizationType(info.ggml_type).name
        if kind in _GGML_INTEGER_TYPES and name.endswith((".weight", ".bias")):
            raise CheckpointError(
                f"{gguf_file.path}: tensor {name} is stored as ggml {kind} integers, which are not a known "
                "quantization; genfn loads float (F32, F16, BF16) and block-quantized (Q8_0, Q4_0, Q4_1, ...) GGUF "
                "weights")
    check_tensors(state_dict, config, gguf_file.path)


def _explain(name: str, config: Any) -> str:
    d = _dims(config)
    if "embed_tokens" in name or "lm_head" in name:
        keys = ("vocab", "hidden")
    elif "q_norm" in name or "k_norm" in name:
        keys = ("heads", "kv_heads", "head_dim") if d["qk_norm_whole"] else ("head_dim",)
    elif "qkv_proj" in name:
        keys = ("heads", "kv_heads", "head_dim", "hidden")
    elif "q_proj" in name or "o_proj" in name:
        keys = ("heads", "head_dim", "hidden")
    elif "k_proj" in name or "v_proj" in name:
        keys = ("kv_heads", "head_dim", "hidden")
    elif "mlp." in name:
        keys = ("intermediate", "hidden")
    else:
        keys = ("hidden",)
    labels = {"vocab": "vocab_size", "hidden": "hidden_size", "heads": "num_attention_heads", "head_dim": "head_dim",
              "kv_heads": "num_key_value_heads", "intermediate": "intermediate_size"}
    return ", ".join(f"{labels[k]}={d[k]}" for k in keys)
