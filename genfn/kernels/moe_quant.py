"""The decode step of a mixture of experts kept in block formats (``genfn.quant.QuantizedExperts``):
``moe_decode_quant`` (``moe_decode.cpp``) for Q8_0/Q4_0/Q4_1/int8/int4 stacks, ``kquant_moe_decode``
(``kquant_linear.cpp``) for Q4_K/Q5_K/Q6_K ones. Both read only the chosen experts' slices of the
stacks (each chosen expert's gate/up and down blocks once per row that chose it) and return the
bytes they read, so a test can count what a token touched.
"""

from __future__ import annotations

import torch

from genfn.kernels import MAX_DECODE_ROWS, decode_linear_available, native
from genfn.kernels.kquant import kquant_available
from genfn.quant.experts import QuantizedExperts
from genfn.quant.kquants import FORMAT_ID

__all__ = ["native_available", "takes", "moe_decode"]

# Read at import: a compiled step must not open files while it is traced. The tile kernel's
# shares need the CPU's vpdpbusd.
_VNNI = native.cpu_has("avx512_vnni")


def takes(x: torch.Tensor, gate_up, down) -> bool:
    """Whether a native kernel runs these rows: a decode step's few rows on the CPU, both
    projections stacked in tile formats (on a CPU with AVX512_VNNI) or both in K-quant formats."""
    if not (isinstance(gate_up, QuantizedExperts) and isinstance(down, QuantizedExperts)):
        return False
    if (x.device.type != "cpu" or gate_up.device.type != "cpu" or not 1 <= x.shape[0] <= MAX_DECODE_ROWS[torch.float32]
            or (torch.is_grad_enabled() and x.requires_grad)):
        return False
    if gate_up.is_k_quant != down.is_k_quant:
        return False
    return native_available(gate_up.is_k_quant)


def native_available(k_quant: bool) -> bool:
    """Whether this machine runs the native MoE kernel of K-quant experts (``k_quant``) or of tile
    formats (those need AVX512_VNNI), the library built or buildable."""
    return kquant_available() if k_quant else _VNNI and decode_linear_available()


def moe_decode(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: QuantizedExperts,
               down: QuantizedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H] in x's dtype, bytes_read)``: for each row of ``x [T, H]``, its ``experts [T, k]``'
    SwiGLUs weighted by ``weights [T, k]`` and summed in the router's order (see ``takes``)."""
    xf, wf = x.float(), weights.float()
    if gate_up.is_k_quant:
        out, read = torch.ops.genfn_kquant.kquant_moe_decode(xf, experts, wf, gate_up.codes, FORMAT_ID[gate_up.format],
                                                             down.codes, FORMAT_ID[down.format])
    else:
        out, read = torch.ops.genfn_kernels.moe_decode_quant(
            xf, experts, wf, gate_up.codes, gate_up.scales, gate_up.mins, gate_up.kind, gate_up.out_features,
            down.codes, down.scales, down.mins, down.kind, down.out_features)
    return out.to(x.dtype), read
