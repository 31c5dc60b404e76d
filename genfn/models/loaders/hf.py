"""Load a Hugging Face checkpoint directory: config.json, safetensors (single or sharded),
generation_config.json and the tokenizer files.

Only safetensors are read: pickled `pytorch_model.bin` files can run code on load, and every
current Hub checkpoint ships safetensors. The config is normalized so that the model code can
read `rope_theta`, `rope_scaling`, `head_dim`, ... without knowing which transformers version
wrote the file (transformers 5 writes `rope_parameters` instead of `rope_theta`/`rope_scaling`).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from . import LoadedCheckpoint
from .checks import FLOAT_DTYPES, check_tensors
from .errors import CheckpointError, check_dtype, check_state_dict
from genfn.models.registry import MODEL_TYPES
from genfn.models.tensor_parallel import cut_pieces

__all__ = ["load_hf_checkpoint", "read_json", "normalize_config", "load_safetensors"]

_ENCODER_DECODER_MODEL_TYPES = ("t5", "mt5", "bart")
_REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def read_json(path: str, what: str = "JSON file") -> Any:
    """Parse a JSON file that must hold an object, turning a syntax error or another top-level
    value (a list, a string) into a CheckpointError that names the file."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: {what} must hold a JSON object ({{\"key\": value, ...}}), got a "
                              f"{type(value).__name__}")
    return value


def _tensor_files(directory: str) -> dict[str, list[str] | None]:
    """{file: [tensor names it should hold] or None (unknown)} for the directory's weights."""
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(index):
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' in the safetensors index")
        files: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            files.setdefault(os.path.join(directory, shard), []).append(name)
        for shard in files:
            if not os.path.isfile(shard):
                raise FileNotFoundError(f"{index} names shard {os.path.basename(shard)}, which does not exist")
        return files
    if os.path.isfile(single):
        return {single: None}
    found = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if found:
        return {f: None for f in found}
    hint = " (only pickled .bin weights found; convert them to safetensors)" if glob.glob(
        os.path.join(directory, "*.bin")) else ""
    raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json{hint}")


# safetensors' dtype names -> torch dtypes (for the shape-only stand-ins of a sliced read).
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


def load_safetensors(
    path: str, dtype: torch.dtype | None = None, names: list[str] | None = None, plan=None, shapes_only: bool = False
) -> dict[str, torch.Tensor]:
    """Read tensors from one safetensors file; float16/32/64 and bfloat16 tensors are cast to `dtype`.

    A corrupt or truncated file raises CheckpointError naming the file; `names`, when given, are
    tensors the index promised and that must be present. `plan(name) -> (dim, start, stop) | None`
    (or a list of such pieces, concatenated along their dim): read only that slice of each tensor
    it names (`safe_open(...).get_slice`: the rest is never read). `shapes_only`: meta tensors of each tensor's shape and dtype, read from the header alone.
    """
    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            if names is not None:
                missing = [n for n in names if n not in keys]
                if missing:
                    raise CheckpointError(
                        f"{path}: tensors listed in the index are missing from the shard: {', '.join(missing[:8])}"
                    )
            for key in keys:
                if shapes_only:
                    part = f.get_slice(key)
                    out[key] = torch.empty(part.get_shape(), dtype=_SAFETENSORS_DTYPES.get(part.get_dtype(),
                                                                                         torch.uint8), device="meta")
                    continue
                cut = None if plan is None else plan(key)
                if cut is None:
                    t = f.get_tensor(key)
                else:  # one piece, or several concatenated (a fused gate/up expert stack's two)
                    part = f.get_slice(key)
                    pieces = cut_pieces(cut)
                    t = torch.cat([part[(slice(None),) * dim + (slice(start, stop),)] for dim, start, stop in pieces],
                                  dim=pieces[0][0])
                if dtype is not None and t.dtype in FLOAT_DTYPES:  # float8 and ints stay, for check_tensors
                    t = t.to(dtype)
                out[key] = t
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors file, it is corrupt or truncated ({e})") from None
    return out


def _rope_fields(config: dict) -> None:
    """Fill both spellings of the rope settings: `rope_theta` + `rope_scaling` (transformers 4) and
    `rope_parameters` (transformers 5). `rope_scaling` is None for plain (unscaled) RoPE."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type parameters
        params = params["full_attention"]
    if isinstance(params, dict):
        config.setdefault("rope_theta", params.get("rope_theta", 10000.0))
        if config.get("rope_scaling") is None:
            kind = params.get("rope_type", params.get("type", "default"))
            extra = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
            config["rope_scaling"] = None if kind == "default" else {**extra, "rope_type": kind}
    else:
        config.setdefault("rope_theta", 10000.0)
        scaling = config.get("rope_scaling")
        if isinstance(scaling, dict):
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            scaling = None if kind == "default" else {**scaling, "rope_type": kind}
        config["rope_scaling"] = scaling
        config["rope_parameters"] = {
            "rope_theta": config["rope_theta"],
            **(scaling or {"rope_type": "default"}),
        }


def normalize_config(config: dict, state_dict: dict[str, torch.Tensor], source: str) -> dict:
    """A copy of config.json with the keys the model code relies on always present.

    Missing values are taken from the transformers defaults or, where the weights say better
    (tied embeddings, qkv biases), inferred from the state dict.
    """
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: config.json must hold a JSON object")
    config = dict(config)
    missing = [k for k in _REQUIRED_CONFIG_KEYS if config.get(k) is None]
    if missing:
        raise CheckpointError(f"{source}: config.json lacks {', '.join(missing)}")
    for key in _REQUIRED_CONFIG_KEYS + ("num_key_value_heads", "head_dim", "intermediate_size"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CheckpointError(f"{source}: config.json's {key} must be an int >= 1, got "
                                  f"{type(value).__name__} {value!r}"[:300])
    model_type = config.get("model_type")
    if not config.get("architectures") and model_type in MODEL_TYPES:
        config["architectures"] = [MODEL_TYPES[model_type]]
    config.setdefault("architectures", [])
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = config["num_attention_heads"]
    if config.get("head_dim") is None:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    _rope_fields(config)
    if "tie_word_embeddings" not in config:
        config["tie_word_embeddings"] = "lm_head.weight" not in state_dict
    if "attention_bias" not in config:
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in state_dict
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
        config.setdefault(key, None)
    config.setdefault("rms_norm_eps", 1e-6)
    return config


def _hf_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Give a bare base-model checkpoint (`layers.0...`) the `model.` prefix, and drop the
    non-persistent RoPE buffers some old checkpoints carry."""
    if "model.embed_tokens.weight" not in state_dict and "embed_tokens.weight" in state_dict:
        state_dict = {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in state_dict.items()}
    return {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}


def _is_encoder_decoder(config: Any) -> bool:
    return isinstance(config, dict) and config.get("model_type") in _ENCODER_DECODER_MODEL_TYPES


def load_hf_checkpoint(directory: str | os.PathLike, dtype: torch.dtype = torch.float32,
                       shard_plan=None) -> LoadedCheckpoint:
    """Load a Hugging Face model directory (see module docstring).

    ``shard_plan(config) -> plan``, with ``plan(name) -> (dim, start, stop) | None``: read only
    that slice of each tensor the plan names (a tensor-parallel rank's,
    ``genfn.models.tensor_parallel.slice_plan``); the whole tensors are checked first from the
    files' headers."""
    check_dtype(dtype)
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory does not exist: {directory}")
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{directory}: no config.json")
    raw_config = read_json(config_path, "config.json")
    files = _tensor_files(directory)

    def read(plan=None, shapes_only=False) -> dict[str, torch.Tensor]:
        state_dict: dict[str, torch.Tensor] = {}
        for path, names in files.items():
            state_dict.update(load_safetensors(path, dtype, names, plan, shapes_only))
        return state_dict

    state_dict = read(shapes_only=shard_plan is not None)  # with a plan: shapes first, slices after
    if _is_encoder_decoder(raw_config):
        # The encoder-decoder families read their own config fields and check their own tensors.
        config = raw_config
        if shard_plan is not None:
            shard_plan(config)  # refuses the model
    else:
        state_dict = _hf_names(state_dict)
        config = normalize_config(raw_config, state_dict, config_path)
        if config["tie_word_embeddings"]:
            state_dict.pop("lm_head.weight", None)
        check_state_dict(state_dict, config, directory)
        check_tensors(state_dict, config, directory)
        if shard_plan is not None:
            state_dict = {k: v for k, v in _hf_names(read(shard_plan(config))).items() if k in state_dict}

    generation_config = None
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(gen_path):
        generation_config = read_json(gen_path, "generation_config.json")

    tokenizer = None
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        from ...tokenizer import Tokenizer

        tokenizer = Tokenizer.from_pretrained(directory)

    return LoadedCheckpoint(config, state_dict, generation_config, tokenizer, directory)
