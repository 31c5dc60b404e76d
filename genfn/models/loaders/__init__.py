"""Checkpoint loaders: Hugging Face directories (config.json + safetensors) and GGUF files.

Both produce the same plain value, `LoadedCheckpoint`: a config dict shaped like Hugging Face's
`config.json`, a state dict under Hugging Face parameter names, the generation config and the
tokenizer. The model code therefore never needs to know which file format the weights came from.

    ckpt = load_checkpoint("path/to/model.gguf")           # or a directory
    ckpt.config["num_hidden_layers"], ckpt.state_dict["model.norm.weight"]
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch

from .errors import CheckpointError, check_dtype

if TYPE_CHECKING:
    from ...tokenizer import Tokenizer

__all__ = [
    "LoadedCheckpoint",
    "CheckpointError",
    "load_checkpoint",
    "load_hf_checkpoint",
    "load_gguf_checkpoint",
    "find_checkpoint_format",
]


@dataclasses.dataclass
class LoadedCheckpoint:
    """Everything a checkpoint holds, format-independent.

    config:            dict shaped like Hugging Face config.json (normalized: `rope_theta`,
                       `rope_scaling`, `head_dim`, `num_key_value_heads`, `tie_word_embeddings`,
                       `attention_bias` always present).
    state_dict:        Hugging Face parameter names -> tensors in the requested dtype;
                       `lm_head.weight` only when embeddings are not tied.
    generation_config: dict from generation_config.json (or GGUF special-token ids), or None.
    tokenizer:         genfn.tokenizer.Tokenizer, or None when the checkpoint has none.
    source:            the path that was loaded.
    """

    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    generation_config: dict[str, Any] | None
    tokenizer: Tokenizer | None
    source: str


def find_checkpoint_format(path: str | os.PathLike) -> tuple[str, str]:
    """("hf" | "gguf", resolved path) for `path`, or raise a clear error.

    A directory with config.json is a Hugging Face checkpoint; a `.gguf` file, or a directory
    holding exactly one `.gguf` file and no config.json, is GGUF.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return "hf", path
        ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
        if len(ggufs) == 1:
            return "gguf", os.path.join(path, ggufs[0])
        if len(ggufs) > 1:
            raise CheckpointError(
                f"{path}: directory holds several .gguf files ({', '.join(ggufs)}); pass one of them"
            )
        raise FileNotFoundError(f"{path}: directory has no config.json and no .gguf file")
    if path.lower().endswith(".gguf"):
        return "gguf", path
    directory = os.path.dirname(os.path.abspath(path))
    if (path.endswith(".safetensors") or os.path.basename(path) == "config.json") and os.path.isfile(
        os.path.join(directory, "config.json")
    ):  # a file inside a Hugging Face directory stands for the directory
        return "hf", directory
    with open(path, "rb") as f:
        if f.read(4) == b"GGUF":
            return "gguf", path
    raise CheckpointError(
        f"{path}: not a checkpoint (expected a directory with config.json, or a .gguf file)"
    )


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype = torch.float32, shard_plan=None,
                    arena=None) -> LoadedCheckpoint:
    """Load a Hugging Face directory or a GGUF file into a LoadedCheckpoint (``shard_plan``: only
    a tensor-parallel rank's slices, see ``load_hf_checkpoint``; ``arena``: where a GGUF file's
    dequantized matrices are written, see ``load_gguf_checkpoint``)."""
    check_dtype(dtype)
    kind, resolved = find_checkpoint_format(path)
    if kind == "hf":
        return load_hf_checkpoint(resolved, dtype=dtype, shard_plan=shard_plan)
    return load_gguf_checkpoint(resolved, dtype=dtype, shard_plan=shard_plan, arena=arena)


# Imported last: both modules build LoadedCheckpoint, defined above.
from .gguf import load_gguf_checkpoint  # noqa: E402
from .hf import load_hf_checkpoint  # noqa: E402
