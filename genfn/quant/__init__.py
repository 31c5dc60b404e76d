"""Weight-only block quantization: GGUF's Q8_0/Q4_0/Q4_1 and channel/group-wise int8/int4.

``RowBlocks`` (blocks.py) is the loading-time form, rows as stored; ``QuantizedWeight``
(weight.py) the runtime pytree in the kernel's tile layout, which ``genfn.kernels.linear``
dispatches to the native VNNI kernel; ``reference_linear`` (reference.py) the same product in
plain torch.
"""

from genfn.quant.blocks import FORMATS, GGUF_FORMATS, RowBlocks, cat_rows, dequantize, from_gguf_bytes, quantize
from genfn.quant.reference import quantize_activations, reference_linear
from genfn.quant.weight import QuantizedWeight

__all__ = ["FORMATS", "GGUF_FORMATS", "RowBlocks", "QuantizedWeight", "cat_rows", "dequantize", "from_gguf_bytes",
           "quantize", "quantize_activations", "reference_linear"]
