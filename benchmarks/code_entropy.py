"""How many fewer bytes a lossless re-coding of a model's weights could read: each format's
order-0 entropy against the bits it stores.

    python benchmarks/code_entropy.py --model llama-1b-q4_0.gguf,llama-1b-q8_0.gguf
    python benchmarks/code_entropy.py --synthetic Q8_0,Q4_0,Q4_K,Q6_K,BF16 --distributions normal,t3

A batch-1 decode step at the 1B shape reads its matrices at about the memory's rate in every
engine, so going faster than a peer that reads the same file at that rate takes reading fewer
bytes without changing a weight (what ``quantize="coded_bf16"`` does for bfloat16). How much
fewer is bounded by the information in the stored fields. For each stored field (a format's codes,
its float16 scales and minimums, a K-quant's sub-block scales; a bfloat16 weight's 16 bits) this
counts the field's values over each matrix and takes the entropy of that histogram: the bits per
value of the best coder that models each value by its matrix's frequencies (an order-0 coder; the
coded bfloat16 form is one such, at a group's granularity). The sum over fields, per weight,
against the stored bits per weight, is the most such a re-coding could shorten a memory-bound
read: ``stored / entropy``. Structure an order-0 count misses (a block's one extreme code, a row's
correlated scales) is small next to the codes: at most log2(32) bits a block of 32 for the extreme
code's position, 0.16 bits a weight.

``--model`` takes GGUF files and counts the matrices a batch-1 token reads (as ``model_bench.py``
does: the embedding table only when it is the head too). ``--synthetic`` quantizes ``--shape``
matrices drawn from ``--distributions`` (``normal``: std 0.02 as ``make_model.py`` writes;
``laplace`` and ``t3``: heavier tails, as trained weights have) into each named ggml type with the
quantizers the benchmark models are written with (``genfn.bench.gguf_matrices``). Where the CPU
has AVX512_BF16 a BF16 matrix's coded size is printed too (``genfn.kernels.encode_coded_bf16``).
Results go to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent

# The ggml types whose fields this counts.
_MEASURED = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
_K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
_DISTRIBUTIONS = ("normal", "laplace", "t3")


def stored_bits(ggml_type: str) -> float:
    """Bits a weight of ``ggml_type`` takes in the file (the gguf package's block sizes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    return 8.0 * block_bytes / weights


def entropy_bits(values: np.ndarray) -> float:
    """Total bits an order-0 coder needs for ``values`` (non-negative integers): their count times
    the entropy of their histogram."""
    counts = np.bincount(values.reshape(-1))
    counts = counts[counts > 0].astype(np.float64)
    total = counts.sum()
    return float(-(counts * np.log2(counts / total)).sum())


def _u16(field: torch.Tensor | np.ndarray) -> np.ndarray:
    array = field.numpy() if isinstance(field, torch.Tensor) else field
    return np.ascontiguousarray(array).view(np.uint16).astype(np.int64)


def field_entropies(raw: np.ndarray, ggml_type: str, shape: tuple[int, ...]) -> dict[str, float]:
    """Bits an order-0 coder needs for each stored field of one matrix (``raw``: its bytes)."""
    from genfn.quant.blocks import GGUF_FORMATS, from_gguf_bytes, unpack_codes
    from genfn.quant.kquants import GGUF_K_FORMATS, unpack_k

    if ggml_type in ("F16", "BF16"):
        return {"value": entropy_bits(_u16(raw))}
    if ggml_type in GGUF_FORMATS:
        blocks = from_gguf_bytes(raw, ggml_type, shape)
        codes = unpack_codes(blocks).numpy().astype(np.int64)
        fields = {"codes": entropy_bits(codes - codes.min()), "d": entropy_bits(_u16(blocks.scales))}
        if blocks.mins is not None:
            fields["m"] = entropy_bits(_u16(blocks.mins))
        return fields
    if ggml_type in _K_QUANTS:
        unpacked = unpack_k(torch.from_numpy(np.array(raw)), GGUF_K_FORMATS[ggml_type])  # a writable copy
        fields = {}
        for name, field in unpacked.items():
            if field.dtype == torch.float16:
                fields[name] = entropy_bits(_u16(field))
            else:
                values = field.numpy().astype(np.int64)
                fields[name] = entropy_bits(values - values.min())
        return fields
    raise ValueError(f"code_entropy: ggml type {ggml_type} is not measured; measured are {', '.join(_MEASURED)}")


def coded_bf16_bits(raw: np.ndarray, shape: tuple[int, ...]) -> float | None:
    """Bits of the matrix as ``quantize="coded_bf16"`` stores it (None where it cannot here)."""
    from genfn import kernels

    if shape[-1] % 64 or not (kernels.native.cpu_has("avx512_bf16") and kernels.decode_linear_available()):
        return None
    weight = torch.from_numpy(np.ascontiguousarray(raw)).view(torch.bfloat16).reshape(shape)
    coded = kernels.encode_coded_bf16(weight)
    return 8.0 * sum(t.numel() * t.element_size() for t in coded.tensors())


class Tally:
    """Per ggml type: weights, stored bits, each field's order-0 bits (and coded bfloat16 bits)."""

    def __init__(self):
        self.types: dict[str, dict[str, float]] = {}

    def add(self, ggml_type: str, raw: np.ndarray, shape: tuple[int, ...], coded: bool) -> None:
        entry = self.types.setdefault(ggml_type, {"weights": 0.0, "stored_bits": 0.0})
        weights = float(math.prod(shape))
        entry["weights"] += weights
        entry["stored_bits"] += weights * stored_bits(ggml_type)
        for name, bits in field_entropies(raw, ggml_type, shape).items():
            entry[f"entropy_{name}"] = entry.get(f"entropy_{name}", 0.0) + bits
        if coded and ggml_type == "BF16":
            bits = coded_bf16_bits(raw, shape)
            if bits is not None:
                entry["coded_bits"] = entry.get("coded_bits", 0.0) + bits

    def rows(self) -> list[dict]:
        """One summary per type, then the whole (``type`` "all")."""
        out = []
        for ggml_type, entry in self.types.items():
            entropy = sum(v for k, v in entry.items() if k.startswith("entropy_"))
            row = {"type": ggml_type, "weights": entry["weights"],
                   "stored_bits_per_weight": entry["stored_bits"] / entry["weights"],
                   "entropy_bits_per_weight": entropy / entry["weights"],
                   "fields_bits_per_weight": {k[len("entropy_"):]: v / entry["weights"]
                                              for k, v in entry.items() if k.startswith("entropy_")},
                   "stored_over_entropy": entry["stored_bits"] / entropy}
            if "coded_bits" in entry:
                row["coded_bits_per_weight"] = entry["coded_bits"] / entry["weights"]
            out.append(row)
        if len(out) > 1:
            stored = sum(r["stored_bits_per_weight"] * r["weights"] for r in out)
            entropy = sum(r["entropy_bits_per_weight"] * r["weights"] for r in out)
            weights = sum(r["weights"] for r in out)
            out.append({"type": "all", "weights": weights, "stored_bits_per_weight": stored / weights,
                        "entropy_bits_per_weight": entropy / weights, "stored_over_entropy": stored / entropy})
        return out


def token_matrices(path: str):
    """(name, ggml type name, shape, raw bytes) of each matrix a batch-1 token reads in a GGUF file."""
    from gguf import GGMLQuantizationType

    from genfn.models.loaders.gguf import read_gguf

    gguf = read_gguf(path)
    tied = "output.weight" not in gguf.tensors
    for name, info in gguf.tensors.items():
        if len(info.shape) == 2 and (tied or name != "token_embd.weight"):
            yield name, GGMLQuantizationType(info.ggml_type).name, info.shape, gguf.raw(name)


def synthetic_matrix(distribution: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if distribution == "normal":
        return torch.randn(shape, generator=generator) * 0.02
    if distribution == "laplace":
        uniform = torch.rand(shape, generator=generator, dtype=torch.float64).clamp_min(1e-12) - 0.5
        return (-0.02 / math.sqrt(2) * uniform.sign() * torch.log1p(-2 * uniform.abs())).float()
    if distribution == "t3":  # Student's t, 3 degrees of freedom, scaled to std 0.02
        normal = torch.randn(shape, generator=generator, dtype=torch.float64)
        chi2 = (torch.randn((3, *shape), generator=generator, dtype=torch.float64) ** 2).sum(0)
        return (normal / torch.sqrt(chi2 / 3) * 0.02 / math.sqrt(3)).float()
    raise ValueError(f"--distributions: {distribution!r} is none of {', '.join(_DISTRIBUTIONS)}")


def _print(label: str, rows: list[dict]) -> None:
    print(f"\n## {label}")
    for row in rows:
        fields = "  ".join(f"{k} {v:.3f}" for k, v in row.get("fields_bits_per_weight", {}).items())
        coded = f"  coded_bf16 {row['coded_bits_per_weight']:.2f}" if "coded_bits_per_weight" in row else ""
        print(f"  {row['type']:5s} {row['weights'] / 1e6:8.1f} M weights  stored {row['stored_bits_per_weight']:6.3f}"
              f"  order-0 entropy {row['entropy_bits_per_weight']:6.3f} bits/weight  stored/entropy "
              f"{row['stored_over_entropy']:.3f}{coded}" + (f"   [{fields}]" if fields else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="comma-separated GGUF files")
    parser.add_argument("--synthetic", default="", help="comma-separated ggml types, e.g. Q8_0,Q4_0,Q4_K,Q6_K,BF16")
    parser.add_argument("--distributions", default="normal,laplace,t3")
    parser.add_argument("--shape", default="2048x2048", help="ROWSxCOLS of each synthetic matrix")
    parser.add_argument("--no-coded", action="store_true", help="skip coding BF16 matrices (coded_bf16)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not args.model and not args.synthetic:
        parser.error("name --model FILES and/or --synthetic TYPES")
    for path in filter(None, args.model.split(",")):
        if not Path(path).is_file():
            parser.error(f"--model: no file {path!r}")
    for ggml_type in filter(None, args.synthetic.split(",")):
        if ggml_type not in _MEASURED:
            parser.error(f"--synthetic: {ggml_type!r} is none of {', '.join(_MEASURED)}")
    for distribution in filter(None, args.distributions.split(",")):
        if distribution not in _DISTRIBUTIONS:
            parser.error(f"--distributions: {distribution!r} is none of {', '.join(_DISTRIBUTIONS)}")
    results = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "files": {}, "synthetic": {}}
    for path in filter(None, args.model.split(",")):
        tally, skipped = Tally(), {}
        for _, ggml_type, shape, raw in token_matrices(path):
            if ggml_type in _MEASURED:
                tally.add(ggml_type, raw, shape, coded=not args.no_coded)
            else:
                skipped[ggml_type] = skipped.get(ggml_type, 0) + 1
        results["files"][path] = tally.rows()
        _print(Path(path).name, results["files"][path])
        if skipped:  # e.g. F32 matrices, whose 32-bit values no histogram here holds
            print("  not measured: " + ", ".join(f"{t} ({n} matrices)" for t, n in sorted(skipped.items())))
    if args.synthetic:
        from genfn.bench.gguf_matrices import encode

        try:
            rows, cols = (int(v) for v in args.shape.lower().split("x"))
        except ValueError:
            parser.error(f"--shape: expected ROWSxCOLS, got {args.shape!r}")
        for distribution in filter(None, args.distributions.split(",")):
            values = synthetic_matrix(distribution, (rows, cols), seed=0)
            for ggml_type in filter(None, args.synthetic.split(",")):
                raw, _ = encode(values, ggml_type)
                tally = Tally()
                tally.add(ggml_type, np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1), (rows, cols),
                          coded=not args.no_coded)
                label = f"{distribution} {rows}x{cols} as {ggml_type}"
                results["synthetic"][label] = tally.rows()
                _print(label, results["synthetic"][label])
    target = Path(args.json or HERE / "results" / f"code-entropy-{time.strftime('%Y-%m-%d-%H%M')}.json")
    target.write_text(json.dumps(results, indent=1))
    print(f"\n# results: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
