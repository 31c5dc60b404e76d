"""A matrix as the bytes a GGUF file stores for it, in any type genfn reads (benchmarks' writers).

The K-quant and IQ4 blocks come from genfn's round-to-nearest quantizers (``genfn.quant``), the
others from genfn's block quantizer; llama.cpp's ``llama-quantize`` searches scales instead, so its
blocks differ in value but not in layout or bytes per weight.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["encode"]


def encode(values: torch.Tensor, ggml_type: str) -> tuple[np.ndarray, object]:
    """(array, raw_dtype) for ``GGUFWriter.add_tensor``: the matrix stored as ``ggml_type``."""
    import gguf

    from genfn.quant.blocks import quantize
    from genfn.quant.kquants import quantize_k

    qtype = gguf.GGMLQuantizationType[ggml_type]
    if ggml_type == "F32":
        return values.float().numpy(), None
    if ggml_type == "F16":
        return values.half().numpy(), None
    if ggml_type == "BF16":
        return values.bfloat16().view(torch.int16).numpy().view(np.uint16).reshape(values.shape).view(np.uint8).reshape(
            values.shape[0], -1), qtype
    if ggml_type == "IQ4_XS" and values.shape[1] % 256:
        return encode(values, "IQ4_NL")
    if ggml_type in ("Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"):
        return quantize_k(values, ggml_type.lower()).data.numpy(), qtype
    if ggml_type in ("Q5_0", "Q5_1"):  # K-quant mixes' fallbacks (no genfn quantizer): the gguf package's
        return gguf.quants.quantize(values.float().numpy(), qtype), qtype
    blocks = quantize(values, ggml_type.lower())
    n, nb = blocks.codes.shape[:2]
    parts = [blocks.scales.reshape(n, nb, 1).view(torch.uint8)]
    if blocks.mins is not None:
        parts.append(blocks.mins.reshape(n, nb, 1).view(torch.uint8))
    parts.append(blocks.codes)
    return torch.cat(parts, dim=-1).reshape(n, -1).numpy(), qtype
