"""K-quant logits and greedy tokens against llama.cpp's, on trained weights, the same file for both.

    python benchmarks/kquant_parity.py                                # every format, 8 prompts, 48 tokens
    python benchmarks/kquant_parity.py --formats q4_k,llama.cpp-q6_k --new-tokens 64

The only trained model here is the shipped SmolLM2-135M (Q4_1). K-quant blocks hold 256 inputs,
and of SmolLM2's matrices only the MLP's down projections are a multiple of 256 wide (1,536; the
rest 576), which is also what ``llama-quantize`` makes of it: it stores the 576-wide matrices in a
fallback type. So each file here is the model's weights (dequantized from the shipped blocks) with
its 30 down projections in the K-quant format under test and every other matrix in float32. Both
engines then quantize activations in one way only, llama.cpp's Q8_K (8 bits per 256 inputs, a
float32 scale) for the K-quant matrices, and leave the float32 ones unquantized:

    q4_k, q5_k, q6_k, iq4_xs    the down projections written by genfn's round-to-nearest quantizer
    llama.cpp-q6_k              the float32 model quantized by llama.cpp itself
                                (``llama_model_quantize``, file type Q6_K: its searching quantizer
                                for the down projections, Q8_0 as its fallback for the rest)
    llama.cpp-q4_k_m            the same, file type Q4_K_M: what a SmolLM2 Q4_K_M download holds
                                (Q4_K/Q6_K down projections, Q5_0 and Q8_0 fallbacks for the rest,
                                which genfn keeps as Q8_0 tiles; both engines quantize the
                                fallbacks' activations per 32 inputs, llama.cpp's scale rounded to
                                float16 as for q8_0 below)
    q8_0                        every matrix Q8_0, no K-quant: llama.cpp rounds each 32-input
                                block's activation scale to float16 (its block_q8_0), genfn keeps
                                it in float32, so here the two do quantize activations differently
    f32                         float32 weights, no activation quantization: the engines' floor

For each file and prompt both engines decode greedily, neither choosing EOS (llama.cpp 0.3.36
through llama-cpp-python with a float32 KV cache; genfn eager on the file's own blocks). It reports
how many leading tokens are equal, and over the steps up to the first difference the largest logit
difference, absolute and relative to the logits' standard deviation; at the first difference, the
two engines' top-2 margins (a difference at a near tie is rounding, not a defect).

The control (``--compiled``, on by default): genfn eager against genfn's compiled step on the same
file, which differ only in the order inductor rounds float32 elementwise work. Once activations
are quantized, a float difference of one ulp upstream can move one 8-bit code across a rounding
boundary, and SmolLM2 carries such a step to the logits (in float32, where nothing is rounded to
codes, the two engines stay within a few hundredths); so the tolerance this states is "as close to
llama.cpp as genfn is to itself".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np
import torch

import genfn
from genfn.bench import llamacpp
from genfn.bench.decode import PROMPTS
from genfn.bench.results import write_results
from genfn.default_model import default_model_path

# One static cache size for every prompt, so each file compiles its step once.
COMPILED_CACHE_LEN = 160
FORMATS = ("q4_k", "q6_k", "llama.cpp-q6_k", "llama.cpp-q4_k_m", "q5_k", "iq4_xs", "q8_0", "f32")


def model_file(fmt: str) -> str:
    source = default_model_path()
    if fmt == "f32":
        return llamacpp.variant_path(source, "F32")
    if fmt == "q8_0":
        return llamacpp.variant_path(source, "Q8_0")
    if fmt in ("llama.cpp-q6_k", "llama.cpp-q4_k_m"):
        return llamacpp_quantized(llamacpp.variant_path(source, "F32"), fmt.split("-")[1].upper())
    return llamacpp.variant_path(source, "F32", {"ffn_down": fmt.upper()})


def llamacpp_quantized(source: str, file_type: str) -> str:
    """``source`` (a float32 file) quantized by llama.cpp's own ``llama_model_quantize``; made once."""
    import llama_cpp as lc

    target = llamacpp.variant_dir() / f"{os.path.basename(source).split('.')[0]}.llama.cpp-{file_type}.gguf"
    if not target.exists():
        params = lc.llama_model_quantize_default_params()
        params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{file_type}")
        params.nthread = 2
        partial = f"{target}.{os.getpid()}.tmp"
        if lc.llama_model_quantize(source.encode(), partial.encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {source} to {file_type}")
        os.replace(partial, target)
    return str(target)


def file_types(path: str) -> dict[str, int]:
    """How many matrices of each type the file holds."""
    import gguf

    from genfn.models.loaders.gguf import read_gguf

    counts: dict[str, int] = {}
    for info in read_gguf(path).tensors.values():
        if len(info.shape) == 2:
            name = gguf.GGMLQuantizationType(info.ggml_type).name
            counts[name] = counts.get(name, 0) + 1
    return counts


def genfn_run(model, ids: list[int], new_tokens: int, eos: int, compiled: bool = False) -> tuple[list[int], np.ndarray]:
    """genfn's greedy tokens and each step's logits: eager (the default), or the compiled step."""
    cache = {"cache_implementation": "static", "max_cache_len": COMPILED_CACHE_LEN} if compiled else {}
    out = genfn.generate(model, torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=eos, **cache)
    logits = torch.stack([step[0] for step in out.logits]).float().numpy()
    return out.sequences[0, len(ids):].tolist(), logits


def compare(ours: list[int], our_logits: np.ndarray, theirs: list[int], their_logits: np.ndarray, eos: int) -> dict:
    """Two greedy runs of one prompt (tokens, logits ``[steps, vocab]``): how many leading tokens
    are equal, the logits' largest difference up to the first different token, and the top-2
    margins there."""
    keep = np.ones(our_logits.shape[1], dtype=bool)
    keep[eos] = False  # genfn's min_new_tokens masks EOS to -inf; neither run may choose it
    equal = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    steps = range(min(equal + 1, len(ours)))
    diffs = [float(np.abs(our_logits[i, keep] - their_logits[i, keep]).max()) for i in steps]
    scale = [float(their_logits[i, keep].std()) for i in steps]
    row = {"equal_tokens": equal, "max_logit_diff": max(diffs), "max_diff_over_std": max(d / s for d, s in zip(diffs, scale))}
    if equal < len(ours):
        def margin(logits):
            top = np.sort(logits[keep])[-2:]
            return float(top[1] - top[0])
        row["margin_at_difference"] = [margin(our_logits[equal]), margin(their_logits[equal])]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, from {FORMATS}")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=True,
                    help="also compare genfn eager with genfn compiled (a float reordering inside one engine)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        ap.error(f"--formats: {', '.join(unknown)} not in {', '.join(FORMATS)}")
    if not llamacpp.available():
        print("llama-cpp-python is not installed (pip install 'genfn[bench]')", file=sys.stderr)
        return 2
    tokenizer = genfn.load(default_model_path(), quantize="gguf").tokenizer
    eos = tokenizer.eos_token_id
    prompts = [tokenizer.encode(p) for p in PROMPTS[:args.prompts]]
    results = {"new_tokens": args.new_tokens, "prompts": len(prompts), "formats": {}}
    out = args.out
    for fmt in formats:
        path = model_file(fmt)
        peer = llamacpp.LlamaCpp(path, threads=2, max_sequences=1, max_len=max(map(len, prompts)) + args.new_tokens,
                                 float32_cache=True)
        model = genfn.load(path, dtype=torch.float32) if fmt == "f32" else genfn.load(path, quantize="gguf")
        rows = []
        for ids in prompts:
            their_logits: list = []
            theirs = peer.generate([ids], args.new_tokens, logits=their_logits, never=eos)[0]
            ours, our_logits = genfn_run(model, ids, args.new_tokens, eos)
            row = compare(ours, our_logits, theirs, np.stack(their_logits[0]), eos)
            if args.compiled:
                row["compiled"] = compare(ours, our_logits, *genfn_run(model, ids, args.new_tokens, eos, True), eos)
            rows.append(row)
        peer.close()
        summary = {
            "file": os.path.basename(path), "matrices": file_types(path),
            "equal_tokens_min": min(r["equal_tokens"] for r in rows),
            "equal_tokens_median": statistics.median(r["equal_tokens"] for r in rows),
            "all_equal": sum(r["equal_tokens"] == args.new_tokens for r in rows),
            "max_logit_diff": max(r["max_logit_diff"] for r in rows),
            "max_diff_over_std": max(r["max_diff_over_std"] for r in rows), "rows": rows}
        if args.compiled:
            summary["eager_vs_compiled"] = {
                "equal_tokens_min": min(r["compiled"]["equal_tokens"] for r in rows),
                "equal_tokens_median": statistics.median(r["compiled"]["equal_tokens"] for r in rows),
                "all_equal": sum(r["compiled"]["equal_tokens"] == args.new_tokens for r in rows),
                "max_logit_diff": max(r["compiled"]["max_logit_diff"] for r in rows)}
        results["formats"][fmt] = summary
        print(f"{fmt:15s} equal tokens min {summary['equal_tokens_min']:3d} median {summary['equal_tokens_median']:5.1f} "
              f"all {summary['all_equal']}/{len(rows)}; logits max |diff| {summary['max_logit_diff']:.4f} "
              f"({summary['max_diff_over_std']:.4f} std); {summary['matrices']}", flush=True)
        if args.compiled:
            own = summary["eager_vs_compiled"]
            print(f"{'':15s} genfn eager vs compiled: equal tokens min {own['equal_tokens_min']:3d} median "
                  f"{own['equal_tokens_median']:5.1f} all {own['all_equal']}/{len(rows)}; logits max |diff| "
                  f"{own['max_logit_diff']:.4f}")
        out = write_results("kquant-parity", results, out)  # after each file: a long run keeps what it measured
        for r in rows:
            if "margin_at_difference" in r:
                print(f"{'':15s}   differs at token {r['equal_tokens']}: top-2 margins genfn "
                      f"{r['margin_at_difference'][0]:.4f}, llama.cpp {r['margin_at_difference'][1]:.4f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
