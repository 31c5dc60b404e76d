"""Random-weight Llama models in real shapes, written as GGUF in every format genfn keeps.

    python benchmarks/make_model.py --shape 1b --formats q4_0,q4_k_m,q8_0,bf16
    python benchmarks/make_model.py --shape 0.5b --formats all --out /tmp/models
    python benchmarks/make_model.py --shape moe --formats q4_0,q8_0

Decode speed does not depend on the weights' values, only on their shapes and formats, so a
model with random weights (normal, std 0.02; norms 1) and a real vocabulary measures what a
trained one of the same shape would. Shapes (dense Llama, SwiGLU, tied embeddings, SmolLM2's
49,152-token vocabulary and tokenizer, copied from the shipped SmolLM2 file):

    135m  SmolLM2-135M's layers: 30, hidden 576, FFN 1536, 9/3 heads of 64 (576 is no multiple of 256:
          see the K-quant fallbacks below)
    0.5b  24 layers, hidden 1024, FFN 4096, 16/8 heads of 64
    1b    Llama-3.2-1B's layers: 16, hidden 2048, FFN 8192, 32/8 heads of 64
    3b    Llama-3.2-3B's layers: 28, hidden 3072, FFN 8192, 24/8 heads of 128
    8b    Llama-3.1-8B's layers: 32, hidden 4096, FFN 14336, 32/8 heads of 128 (7.2B weights with
          this vocabulary; Q4_K_M 4.4 GB, written in about six minutes)
    moe   a mixture of experts (``qwen3moe``): Qwen3-30B-A3B's layer, hidden 2048, 32/4 heads of 128
          with q/k norms, 128 experts of FFN 768 of which 8 are chosen per token, but 4 of its 48
          layers (a 1.5 GB Q4_0 file, written in about a minute; a token reads 8/128 of the experts)

In a MoE file the three expert projections of a layer are llama.cpp's stacks
(``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, ``[experts, rows, cols]``) in the
format's type, the router (``ffn_gate_inp``) and the norms F32.

Formats: f32, f16, bf16 (every matrix in that type), q8_0, q4_0, q4_1 (every linear; the tied
embedding/output matrix in Q6_K for the 4-bit ones and Q8_0 for q8_0, as ``llama-quantize``
keeps the output matrix), q4_k, q6_k (all linears and the embedding), q4_k_m, llama.cpp's
Q4_K_M mix: Q4_K everywhere except the v and down projections of the first and last eighth of
the layers and of every third layer between (Q6_K) and the output matrix (Q6_K), q5_k_m, the same
mix on Q5_K, and iq4_nl,
iq4_xs (every linear; the tied embedding/output matrix in Q6_K; an IQ4_XS matrix whose rows are
not a multiple of 256 inputs is written IQ4_NL, as llama.cpp does, though every shape here is
one). Norms are F32. Blocks are written with genfn's round-to-nearest quantizers
(``genfn.bench.gguf_matrices.encode``), not llama.cpp's searching ones: same layout, same
bytes per weight.
Files go to ``--out`` (default ``$GENFN_BENCH_DIR`` or ``~/.cache/genfn/models``) as
``<architecture>-<shape>-<format>.gguf`` (``llama-1b-q4_0.gguf``, ``qwen3moe-moe-q4_0.gguf``); an
existing file is kept.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from genfn.bench.gguf_matrices import encode

SHAPES = {
    "135m": dict(layers=30, hidden=576, ffn=1536, heads=9, kv_heads=3, head_dim=64),
    "0.5b": dict(layers=24, hidden=1024, ffn=4096, heads=16, kv_heads=8, head_dim=64),
    "1b": dict(layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64),
    "3b": dict(layers=28, hidden=3072, ffn=8192, heads=24, kv_heads=8, head_dim=128),
    "8b": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128),
    "moe": dict(layers=4, hidden=2048, ffn=768, heads=32, kv_heads=4, head_dim=128, experts=128, experts_used=8),
}
FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "q4_k_m", "q5_k_m", "iq4_nl", "iq4_xs")
_FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q4_k": 14, "q6_k": 18, "q4_k_m": 15, "q5_k_m": 17, "bf16": 32,
              "iq4_nl": 25, "iq4_xs": 30}


def model_dir() -> Path:
    return Path(os.environ.get("GENFN_BENCH_DIR") or Path.home() / ".cache" / "genfn" / "models")


def _arch(shape: str) -> str:
    return "qwen3moe" if "experts" in SHAPES[shape] else "llama"


def model_path(shape: str, fmt: str, out: Path | None = None) -> Path:
    return (out or model_dir()) / f"{_arch(shape)}-{shape}-{fmt}.gguf"


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose v/down projections Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


# What llama-quantize writes instead of a 256-input super-block type where a matrix's rows are no
# multiple of 256 inputs (llama.cpp's llama-quant.cpp; IQ4_XS's fallback is encode's own).
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def tensor_type(fmt: str, part: str, layer: int | None, layers: int, cols: int = 256) -> str:
    """The ggml type of a matrix (``part``: GGUF name stem, e.g. ``attn_v`` or ``token_embd``) of
    ``cols`` inputs."""
    if fmt in ("f32", "f16", "bf16", "q4_k", "q6_k"):
        kind = fmt.upper()
    elif part == "token_embd":  # tied: it is the output matrix too
        kind = "Q8_0" if fmt == "q8_0" else "Q6_K"
    elif fmt in ("q4_k_m", "q5_k_m"):
        base = "Q4_K" if fmt == "q4_k_m" else "Q5_K"
        kind = "Q6_K" if part in ("attn_v", "ffn_down") and _more_bits(layer, layers) else base
    else:
        kind = fmt.upper()
    return K_FALLBACK.get(kind, kind) if cols % 256 else kind


def _tokenizer_fields(writer) -> None:
    """SmolLM2's tokenizer (vocabulary, merges, special ids, chat template) from the shipped file."""
    import gguf

    from genfn.default_model import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)


def make(shape: str, fmt: str, path: Path, seed: int = 0) -> None:
    import gguf

    s = SHAPES[shape]
    vocab = 49152
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    arch = _arch(shape)
    writer = gguf.GGUFWriter(str(partial), arch)
    writer.add_name(f"random {arch} {shape} ({fmt})")
    writer.add_file_type(_FILE_TYPE[fmt])
    writer.add_block_count(s["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_dimension_count(s["head_dim"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(vocab)
    if "experts" in s:
        writer.add_expert_count(s["experts"])
        writer.add_expert_used_count(s["experts_used"])
        writer.add_expert_feed_forward_length(s["ffn"])
    _tokenizer_fields(writer)
    generator = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * 0.02

    def add(name: str, part: str, layer: int | None, rows: int, cols: int) -> None:
        array, raw = encode(matrix(rows, cols), tensor_type(fmt, part, layer, s["layers"], cols))
        writer.add_tensor(name, array, raw_dtype=raw)

    def add_experts(name: str, part: str, layer: int, rows: int, cols: int) -> None:
        """A stack ``[experts, rows, cols]``, quantized a few experts at a time (bounded memory)."""
        chunks, raw = [], None
        for start in range(0, s["experts"], 16):
            count = min(16, s["experts"] - start)
            array, raw = encode(matrix(count * rows, cols), tensor_type(fmt, part, layer, s["layers"], cols))
            chunks.append(array.reshape(count, rows, -1))
        writer.add_tensor(name, np.concatenate(chunks), raw_dtype=raw)

    hidden, kv = s["hidden"], s["kv_heads"] * s["head_dim"]
    add("token_embd.weight", "token_embd", None, vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(s["layers"]):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for part, rows, cols in (("attn_q", s["heads"] * s["head_dim"], hidden), ("attn_k", kv, hidden),
                                 ("attn_v", kv, hidden), ("attn_output", hidden, s["heads"] * s["head_dim"])):
            add(f"blk.{i}.{part}.weight", part, i, rows, cols)
        if "experts" not in s:
            for part, rows, cols in (("ffn_gate", s["ffn"], hidden), ("ffn_up", s["ffn"], hidden),
                                     ("ffn_down", hidden, s["ffn"])):
                add(f"blk.{i}.{part}.weight", part, i, rows, cols)
            continue
        for norm in ("attn_q_norm", "attn_k_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(s["head_dim"], dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", matrix(s["experts"], hidden).numpy())
        for part, rows, cols in (("ffn_gate_exps", s["ffn"], hidden), ("ffn_up_exps", s["ffn"], hidden),
                                 ("ffn_down_exps", hidden, s["ffn"])):
            add_experts(f"blk.{i}.{part}.weight", part, i, rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, path)


def ensure(shape: str, fmt: str, out: Path | None = None) -> Path:
    """The file of ``shape`` in ``fmt``, made on first use."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}; got {shape!r}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    path = model_path(shape, fmt, out)
    if not path.exists():
        make(shape, fmt, path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="q4_0,q4_k_m,q8_0,bf16", help=f"comma list of {', '.join(FORMATS)}, or all")
    ap.add_argument("--out", default=None, help="directory (default $GENFN_BENCH_DIR or ~/.cache/genfn/models)")
    args = ap.parse_args(argv)
    formats = FORMATS if args.formats == "all" else [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        ap.error(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    for fmt in formats:
        t = time.perf_counter()
        path = ensure(args.shape, fmt, Path(args.out) if args.out else None)
        print(f"{args.shape} {fmt}: {path} ({path.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - t:.0f} s)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
