"""Turning a model's linear weights into ``QuantizedWeight``s: ``genfn.load(path, quantize=...)``.

``quantize="gguf"`` keeps a GGUF file's own Q8_0/Q4_0/Q4_1 blocks (the loader hands them over as
``RowBlocks``; they are only rearranged into the kernel's tiles) and its Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS
blocks as stored (``KQuantWeight``; a fused matrix whose parts differ in format is a ``RowStack``); ``"q8_0" | "q4_0" | "q4_1" |
"int8" | "int4"`` quantizes the float weights (a GGUF file's after dequantizing them). Only the
matrices that linears multiply by change: q/k/v, o, gate/up, down (a mixture of experts' stacked
experts, as ``QuantizedExperts``) and the LM head. Norms stay float. A GGUF file's quantized
embedding stays quantized (``genfn.kernels.embedding`` dequantizes the rows a step looks up; a
tied head and the embedding are one ``QuantizedWeight``), so SmolLM2's Q4_1 file no longer
carries a 113 MB float32 copy of its table; quantizing a float model on load keeps its float
embedding (the head's quantized values would change the inputs).

With a 4-bit format the LM head is stored in 8 bits (q8_0, or int8 for int4), as llama.cpp's
quantizer keeps its output matrix at higher precision and the shipped SmolLM2 file has it in
Q8_0: the head is a tenth of the bytes, and at 4 bits it alone cost SmolLM2 a third more
perplexity (benchmarks/quality.py).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from genfn.kernels import encode_coded_bf16
from genfn.models.weight_arena import release_file_pages
from genfn.quant.blocks import BLOCK, FORMATS, RowBlocks, quantize
from genfn.quant.coded_bf16 import encodable
from genfn.quant.experts import QuantizedExperts
from genfn.quant.kquants import KQuantWeight
from genfn.quant.stack import RowStack
from genfn.quant.weight import TILE, QuantizedWeight

__all__ = ["CODED_BF16", "QUANTIZE_CHOICES", "check_quantize", "quantize_params", "LINEAR_PARAMS"]

# Not a quantization: bfloat16 linears coded losslessly in 12.2 bits a weight (genfn.quant.coded_bf16).
CODED_BF16 = "coded_bf16"
QUANTIZE_CHOICES = ("gguf", *FORMATS, CODED_BF16)
HEAD_FORMAT = {"q4_0": "q8_0", "q4_1": "q8_0", "q5_0": "q8_0", "q5_1": "q8_0", "int4": "int8"}
LINEAR_PARAMS = ("wqkv", "wo", "w_gate_up", "w_down")
# A mixture of experts' stacked projections (genfn.models.moe), quantized expert by expert.
EXPERT_PARAMS = ("experts_gate_up", "experts_down")


def check_quantize(quantize: str | None) -> str | None:
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be None or one of {', '.join(map(repr, QUANTIZE_CHOICES))}; got {quantize!r}")
    return quantize


def _quantized(weight: Any, fmt: str, name: str, kept_float: list, arena=None) -> Any:
    if fmt == CODED_BF16:
        if encodable(weight):
            coded = encode_coded_bf16(weight, arena)
            release_file_pages(weight)  # read once: a file's floats leave resident memory as they are coded
            return coded
        kept_float.append(name)
        return weight
    if isinstance(weight, RowBlocks):
        return QuantizedWeight.from_rows(weight)
    if isinstance(weight, KQuantWeight):  # a GGUF file's K-quant blocks: the kernel reads them as stored
        return weight
    if isinstance(weight, RowStack):
        return weight.map_parts(lambda part: _quantized(part, fmt, name, kept_float))
    if fmt == "gguf":  # a float matrix in the file stays float
        return weight
    group = 64 if fmt == "int4" else BLOCK
    if weight.dim() != 2 or weight.shape[1] % group:
        kept_float.append(name)
        return weight
    return QuantizedWeight.from_rows(quantize(weight, fmt))


def _quantized_experts(weight: Any, fmt: str, name: str, kept_float: list) -> Any:
    """A stacked expert projection ``[E, out, in]``: a GGUF file's blocks stay as loaded
    (``QuantizedExperts``), float experts are quantized per expert row by row like any matrix."""
    if isinstance(weight, QuantizedExperts) or fmt in ("gguf", CODED_BF16):
        return weight
    num_experts, rows, cols = weight.shape
    if cols % (64 if fmt == "int4" else BLOCK) or rows % TILE:  # each expert fills whole tiles
        kept_float.append(name)
        return weight
    return QuantizedExperts.from_blocks(quantize(weight.reshape(-1, cols), fmt), num_experts)


def quantize_params(params: dict, fmt: str, arena=None) -> dict:
    """``params`` with its linear weights as ``QuantizedWeight`` in ``fmt`` (see module docstring);
    ``arena``: where coded bfloat16 weights are written (quantized ones are placed by the caller)."""
    check_quantize(fmt)
    kept_float: list[str] = []
    layers = []
    for i, layer in enumerate(params["layers"]):
        layer = dict(layer)
        for key in LINEAR_PARAMS:
            if key in layer:  # a mixture of experts' layer has no w_gate_up/w_down, but stacked experts
                layer[key] = _quantized(layer[key], fmt, f"layers.{i}.{key}", kept_float, arena)
        for key in EXPERT_PARAMS:
            if key in layer:
                layer[key] = _quantized_experts(layer[key], fmt, f"layers.{i}.{key}", kept_float)
        layers.append(layer)
    head = _quantized(params["lm_head"], HEAD_FORMAT.get(fmt, fmt), "lm_head", kept_float, arena)
    embed = params["embed"]
    if fmt == CODED_BF16 and embed is params["lm_head"]:  # tied: the lookup decodes the head's rows
        embed = head
    if isinstance(embed, RowBlocks):  # a GGUF file's blocks: the lookup reads them in place
        embed = head if embed is params["lm_head"] else QuantizedWeight.from_rows(embed)
    out = dict(params, layers=layers, lm_head=head, embed=embed)
    if kept_float:
        why = ("not bfloat16 [N, K] with K a multiple of 64" if fmt == CODED_BF16
               else "in_features not a multiple of the block size")
        warnings.warn(f"genfn: quantize={fmt!r}: {', '.join(kept_float[:4])} kept in float ({why})", RuntimeWarning,
                      stacklevel=3)
    return out


def weight_bytes(params: dict) -> int:
    """Bytes a batch-1 decode step streams: every linear weight once (a tied head counted once)."""
    seen, total = set(), 0
    for leaf in torch.utils._pytree.tree_leaves({k: v for k, v in params.items() if k != "embed"}):
        if isinstance(leaf, torch.Tensor) and leaf.data_ptr() not in seen:
            seen.add(leaf.data_ptr())
            total += leaf.numel() * leaf.element_size()
    return total
