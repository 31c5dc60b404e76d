"""Weight-only block quantization: GGUF's Q8_0/Q4_0/Q4_1, its K-quants Q4_K/Q5_K/Q6_K and IQ4_NL/IQ4_XS
(kquants.py and iq4.py, kept as the file stores them) and channel/group-wise int8/int4.

``RowBlocks`` (blocks.py) is the loading-time form, rows as stored; ``QuantizedWeight``
(weight.py) the runtime pytree in the kernel's tile layout, which ``genfn.kernels.linear``
dispatches to the native VNNI kernel; ``reference_linear`` (reference.py) the same product in
plain torch. ``QuantizedExperts`` (experts.py) is a mixture of experts' stacked projection in any
of these formats, each expert's blocks a slice the MoE kernels read alone. ``CodedBfloat16``
(coded_bf16.py) is not a quantization: a bfloat16 matrix kept bit for bit in 12.2 bits a weight.
"""

from genfn.quant.blocks import FORMATS, GGUF_FORMATS, RowBlocks, dequantize, from_gguf_bytes, quantize
from genfn.quant.coded_bf16 import CodedBfloat16
from genfn.quant.experts import QuantizedExperts
from genfn.quant.fuse import cat_rows
from genfn.quant.kquants import GGUF_K_FORMATS, K_FORMATS, KQuantWeight, dequantize_k, quantize_k, reference_linear_k
from genfn.quant.reference import quantize_activations, reference_linear
from genfn.quant.stack import RowStack
from genfn.quant.weight import QuantizedWeight

# The weight types the native kernels take as they are (kept whole as pytree nodes by the driver).
QUANTIZED_TYPES = (QuantizedWeight, KQuantWeight, QuantizedExperts, CodedBfloat16)

__all__ = ["FORMATS", "GGUF_FORMATS", "RowBlocks", "QuantizedWeight", "cat_rows", "dequantize", "from_gguf_bytes",
           "quantize", "quantize_activations", "reference_linear", "KQuantWeight", "K_FORMATS", "GGUF_K_FORMATS",
           "dequantize_k", "quantize_k", "reference_linear_k", "RowStack", "QuantizedExperts", "QUANTIZED_TYPES",
           "CodedBfloat16"]
