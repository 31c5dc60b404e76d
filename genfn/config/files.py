"""GenerationConfig as JSON and on disk: plain-data conversion, JSON-safe keys, local file lookup.

genfn is offline: a config loads from a local directory or file; a Hub model id gets an error that
says how to download it.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["GENERATION_CONFIG_NAME"]

GENERATION_CONFIG_NAME = "generation_config.json"


def plain_data(value: Any) -> Any:
    """Nested configs (anything with ``to_dict``) as dicts, recursively through dicts and lists."""
    if hasattr(value, "to_dict") and not isinstance(value, type):
        return plain_data(value.to_dict())
    if isinstance(value, Mapping):
        return {key: plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    return value


def dtypes_to_names(config_dict: dict[str, Any]) -> None:
    """``torch.float16`` -> ``"float16"`` under any ``dtype`` key, so cache configs fit in JSON."""
    dtype = config_dict.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        config_dict["dtype"] = str(dtype).split(".")[-1]
    for value in config_dict.values():
        if isinstance(value, dict):
            dtypes_to_names(value)


def string_keys(value: Any) -> Any:
    """JSON object keys must be strings: ``(1, 2)`` is written ``"(1, 2)"``, as transformers does."""
    if isinstance(value, Mapping):
        return {str(key): string_keys(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [string_keys(item) for item in value]
    return value


HUB_ONLY_KWARGS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "token",
    "proxies",
    "_from_auto",
    "_from_pipeline",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def find_local_config_file(name: str | os.PathLike, subfolder: str, config_file_name: str | os.PathLike) -> str:
    base = os.fspath(name)
    if subfolder:
        base = os.path.join(base, subfolder)
    if os.path.isfile(base):
        return base
    if os.path.isdir(base):
        path = os.path.join(base, os.fspath(config_file_name))
        if os.path.isfile(path):
            return path
        raise FileNotFoundError(f"The directory {base!r} has no {os.fspath(config_file_name)!r} file.")
    message = f"genfn loads configurations from local paths only (it is offline): {base!r} does not exist."
    if _HUB_ID.match(os.fspath(name)):
        message += (
            f" {os.fspath(name)!r} looks like a Hugging Face Hub model id: download it first "
            f"(e.g. `huggingface-cli download {os.fspath(name)}`) and pass the local directory."
        )
    raise FileNotFoundError(message)


def read_json_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as reader:
            data = json.load(reader)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise OSError(f"{path!r} is not a valid JSON file: {err}") from err
    if not isinstance(data, dict):
        raise OSError(f"{path!r} must hold a JSON object, got {type(data).__name__}.")
    return data


def model_config_as_dict(model_config: Any) -> dict[str, Any]:
    if isinstance(model_config, Mapping):
        return copy.deepcopy(dict(model_config))
    if hasattr(model_config, "to_dict"):
        return dict(model_config.to_dict())
    raise TypeError(
        "`model_config` must be a dict (a parsed config.json) or have a to_dict() method, "
        f"got {type(model_config).__name__}."
    )


def decoder_config_as_dict(model_config: Any, top: dict[str, Any]) -> dict[str, Any]:
    """The sub-config of the part that decodes, where composite models keep their token ids."""
    if not isinstance(model_config, Mapping):
        if hasattr(model_config, "get_text_config"):
            return dict(model_config.get_text_config(decoder=True).to_dict())
        return top
    for name in ("decoder", "generator", "text_config"):
        sub = model_config.get(name)
        if sub:
            return dict(sub) if isinstance(sub, Mapping) else model_config_as_dict(sub)
    return top
