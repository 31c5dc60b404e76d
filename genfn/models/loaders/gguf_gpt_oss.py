"""GPT-OSS in GGUF files (llama.cpp's ``gpt-oss``): its settings, and its tensors under transformers'
names and layout.

llama.cpp's converter splits transformers' ``gate_up_proj [E, H, 2I]`` (gate and up in alternating
columns) into ``ffn_gate_exps`` and ``ffn_up_exps`` ``[E, I, H]`` (biases ``[E, I]``), transposes
``down_proj [E, I, H]`` into ``ffn_down_exps [E, H, I]``, stores the expert stacks in MXFP4 (its
other tensors as F32/F16/BF16 or a block format), and names the sinks ``attn_sinks.weight`` and the
router ``ffn_gate_inp``. It fixes, without writing keys for them: every other layer (the even ones)
sliding-window, and the clamped SwiGLU's alpha 1.702 and limit 7.0. The loader dequantizes the
expert stacks (MXFP4 through ``gguf.quants.dequantize``, bit for bit) to the requested dtype and
puts them back in transformers' layout, which ``genfn.models.gpt_oss`` reads.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import CheckpointError

__all__ = ["ARCH", "BLOCK_NAMES", "alternate_rows", "config_fields", "keeps_blocks", "transformers_layout"]

ARCH = "gpt-oss"
# llama.cpp's block tensor names that differ from the other families' meaning.
BLOCK_NAMES = {"ffn_gate_inp": "mlp.router", "attn_sinks": "self_attn.sinks"}


def config_fields(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The config fields a GPT-OSS file implies beyond the common ones in ``config``."""
    layers = int(metadata[f"{ARCH}.block_count"])
    fields: dict[str, Any] = {
        "sliding_window": metadata.get(f"{ARCH}.attention.sliding_window"),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
    }
    scaling = config.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type") == "yarn":
        # transformers' GPT-OSS YaRN: llama.cpp's default betas, a ramp over fractional dimensions.
        scaling = {"beta_fast": 32.0, "beta_slow": 1.0, **scaling, "truncate": False}
        fields.update(rope_scaling=scaling, rope_parameters={"rope_theta": config["rope_theta"], **scaling})
    return fields


def keeps_blocks(gguf_name: str) -> bool:
    """Whether a tensor of a GPT-OSS file may stay in its blocks: not the expert stacks, which
    ``genfn.models.moe.biased_moe_mlp`` runs as floats (``quantize=`` can requantize them)."""
    return "_exps." not in gguf_name


def _pop(state_dict: dict[str, Any], name: str, path: str):
    try:
        return state_dict.pop(name)
    except KeyError:
        raise CheckpointError(f"{path}: GPT-OSS GGUF is missing the tensor for {name}") from None


def alternate_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate, up [E, I, ...]`` -> ``[E, 2I, ...]`` with gate row j at 2j and up row j at 2j + 1
    (transformers' GPT-OSS gate/up order, along the dimension after the experts')."""
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def transformers_layout(state_dict: dict[str, Any], path: str) -> dict[str, Any]:
    """The state dict with the experts, the router and the sinks as transformers names and shapes them."""
    for name in [n for n in state_dict if n.endswith(".self_attn.sinks.weight")]:
        state_dict[name[: -len(".weight")]] = state_dict.pop(name)
    for name in [n for n in state_dict if n.endswith(".mlp.experts.gate_proj.weight")]:
        stem = name[: -len("gate_proj.weight")]
        gate, up = state_dict.pop(name), _pop(state_dict, stem + "up_proj.weight", path)
        state_dict[stem + "gate_up_proj"] = alternate_rows(gate, up).transpose(1, 2)  # [E, H, 2I]
        state_dict[stem + "gate_up_proj_bias"] = alternate_rows(_pop(state_dict, stem + "gate_proj.bias", path),
                                                              _pop(state_dict, stem + "up_proj.bias", path))
        state_dict[stem + "down_proj"] = _pop(state_dict, stem + "down_proj.weight", path).transpose(1, 2)
        state_dict[stem + "down_proj_bias"] = _pop(state_dict, stem + "down_proj.bias", path)
    return state_dict
