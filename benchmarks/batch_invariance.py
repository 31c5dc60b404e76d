"""Which of genfn's kernels are batch-invariant: is ``f(x[:1])`` bitwise equal to ``f(x)[:1]``?

In the spirit of Thinking Machines' check (``batch_invariant_ops``): for every linear kernel genfn
runs (``genfn.kernels.linear``: the decode kernel up to ``MAX_DECODE_ROWS`` rows, ``F.linear``
beyond; the quantized kernel for Q8_0/Q4_0/Q4_1 blocks; the packed GEMM of continuous batching),
the attention kernels and RMSNorm, on SmolLM2's shapes, at row counts 1..64: row 0 computed
alone against row 0 computed among ``n - 1`` other rows. Also the row counts at which the result
on 1 and on 2 threads differs. Prints one line per kernel: the row counts where row 0 changed
and the largest difference.

    python benchmarks/batch_invariance.py [--rows 64] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from genfn import kernels
from genfn.kernels.packed_gemm import PackedWeight, bf16_gemm_available, packed_linear, packing_available
from genfn.quant.blocks import quantize
from genfn.quant.weight import QuantizedWeight

HIDDEN, INTERMEDIATE, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 49152, 9, 3, 64
SHAPES = {"576->576": (HIDDEN, HIDDEN), "576->3072": (HIDDEN, 2 * INTERMEDIATE), "1536->576": (INTERMEDIATE, HIDDEN),
          "576->49152": (HIDDEN, VOCAB)}


def rms_norm_torch(x, weight, eps=1e-5):
    from genfn.models.llama import _rms_norm

    return _rms_norm(x, weight, eps)


def probes(dtype_filter=None):
    """``name -> (make_input(n) -> x, f(x) -> y)``: ``x``'s first row is the same for every n."""
    torch.manual_seed(0)
    out = {}

    def rows_of(k, dtype):
        base = torch.randn(64, k).to(dtype)
        return lambda n: base[:n].contiguous()

    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        for shape_name, (k, n_out) in SHAPES.items():
            weight = (torch.randn(n_out, k) / k ** 0.5).to(dtype)
            out[f"F.linear {name} {shape_name}"] = (rows_of(k, dtype), lambda x, w=weight: F.linear(x, w))
            out[f"kernels.linear {name} {shape_name}"] = (rows_of(k, dtype), lambda x, w=weight: kernels.linear(x, w))
            if (dtype == torch.bfloat16 and bf16_gemm_available()) or packing_available():
                packed = PackedWeight(weight)
                out[f"packed_linear ({packed.kind}) {name} {shape_name}"] = (
                    rows_of(k, dtype), lambda x, p=packed: packed_linear(x, p))
        norm = torch.randn(HIDDEN).to(dtype)
        out[f"RMSNorm (torch) {name}"] = (rows_of(HIDDEN, dtype), lambda x, w=norm: rms_norm_torch(x, w))
        if kernels.decode_linear_available():
            out[f"RMSNorm (native) {name}"] = (rows_of(HIDDEN, dtype),
                                               lambda x, w=norm: torch.ops.genfn_kernels.rms_norm(x, w, 1e-5))
        # Decode attention: one query per row against 300 cached positions; the other rows see
        # other lengths (their masks), row 0 always the same.
        length = 300
        q_all = torch.randn(64, HEADS, 1, HEAD_DIM).to(dtype)
        k_all = torch.randn(64, KV_HEADS, length, HEAD_DIM).to(dtype)
        v_all = torch.randn(64, KV_HEADS, length, HEAD_DIM).to(dtype)
        visible = torch.arange(length)[None, :] < torch.randint(1, length + 1, (64, 1))
        visible[0] = torch.arange(length) < 257
        mask_all = visible[:, None, None, :]
        make = lambda n: n  # noqa: E731  (the row count; the kernels slice their batch)
        out[f"decode_attention (native) {name}"] = (make, lambda n, q=q_all, k=k_all, v=v_all, m=mask_all:
                                                    _decode_attention(q[:n], k[:n], v[:n], m[:n]))
        out[f"F.scaled_dot_product_attention decode {name}"] = (
            make, lambda n, q=q_all, k=k_all, v=v_all, m=mask_all:
            F.scaled_dot_product_attention(q[:n], k[:n], v[:n], attn_mask=m[:n], enable_gqa=True))
    for fmt in ("q8_0", "q4_0", "q4_1"):
        for shape_name, (k, n_out) in SHAPES.items():
            weight = QuantizedWeight.from_rows(quantize(torch.randn(n_out, k) / k ** 0.5, fmt))
            out[f"kernels.linear {fmt} (float32 x) {shape_name}"] = (rows_of(k, torch.float32),
                                                                    lambda x, w=weight: kernels.linear(x, w))
    return out


def _decode_attention(q, k, v, m):
    y = kernels.decode_attention(q, k, v, m)
    if y is None:
        raise RuntimeError("the native decode attention does not take these arguments here")
    return y


def check(make, f, max_rows: int) -> dict:
    alone = f(make(1))[:1]
    changed, worst = [], 0.0
    for n in range(2, max_rows + 1):
        row = f(make(n))[:1]
        if not torch.equal(row, alone):
            changed.append(n)
            worst = max(worst, (row.float() - alone.float()).abs().max().item())
    before, thread_changed = torch.get_num_threads(), []
    try:
        for n in range(1, max_rows + 1):
            torch.set_num_threads(1)
            one = f(make(n))
            torch.set_num_threads(2)
            if not torch.equal(f(make(n)), one):
                thread_changed.append(n)
    finally:
        torch.set_num_threads(before)
    return {"batch_invariant": not changed, "changed_at_rows": changed, "max_abs_diff": worst,
            "threads_changed_at_rows": thread_changed}


def _ranges(values: list[int]) -> str:
    if not values:
        return "-"
    parts, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--only", default=None, help="probe names containing this text")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with torch.inference_mode():
        results = {}
        for name, (make, f) in probes().items():
            if args.only and args.only not in name:
                continue
            results[name] = check(make, f, args.rows)
            if not args.json:
                r = results[name]
                print(f"{name:50s} {'invariant' if r['batch_invariant'] else 'VARIANT':9s} "
                      f"rows changed: {_ranges(r['changed_at_rows']):10s} max |diff| {r['max_abs_diff']:.3g}  "
                      f"1 vs 2 threads differ at rows: {_ranges(r['threads_changed_at_rows'])}", flush=True)
    if args.json:
        print(json.dumps({"kernel_status": kernels.kernel_status(), "threads": torch.get_num_threads(),
                          "results": results}))
    else:
        print(f"kernels: {kernels.kernel_status()}; torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
