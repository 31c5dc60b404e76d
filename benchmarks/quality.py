"""What each weight format costs in quality, measured: perplexity and greedy agreement.

    python benchmarks/quality.py                  # every format, the shipped SmolLM2
    python benchmarks/quality.py --formats float32,q4_1 --new-tokens 32

Perplexity is over ``tests/data/perplexity.txt`` (a fixed text written for this, ~1.4k tokens,
read in one window). Agreement: the benchmark prompts decoded greedily for ``--new-tokens``
tokens in each format, compared with float32 position by position, and how many tokens each
row keeps before its first difference. Formats as in ``benchmarks/decode.py``: q4_1 is the
shipped file's own blocks; q8_0/q4_0 files made from it; int8/int4 quantized on load; all of
them therefore start from the same Q4_1 weights, and float32 is those weights dequantized.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

import torch

from genfn.bench import llamacpp  # noqa: E402

from genfn.bench.results import write_results  # noqa: E402
from genfn.bench.decode import GGUF_TYPE_OF, PROMPTS, batch_inputs  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "perplexity.txt"
FORMATS = ("float32", "bfloat16", "q8_0", "q4_0", "q4_1", "int8", "int4")


def load(genfn, fmt: str):
    from genfn.default_model import default_model_path

    path = default_model_path()
    if fmt in ("float32", "bfloat16"):
        return genfn.load(path, dtype=getattr(torch, fmt))
    if fmt in GGUF_TYPE_OF:
        return genfn.load(llamacpp.variant_path(path, GGUF_TYPE_OF[fmt]), quantize="gguf")
    return genfn.load(path, quantize=fmt)


def perplexity(model, ids: list[int]) -> float:
    tokens = torch.tensor([ids])
    cache = model.init_cache(1, len(ids))
    with torch.no_grad():
        logits, _ = model.apply(tokens, torch.arange(len(ids)).unsqueeze(0), cache)
    nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), tokens[0, 1:])
    return math.exp(nll.item())


def greedy(genfn, model, input_ids, mask, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        out = genfn.generate(model, input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=2)
    return out[:, input_ids.shape[1]:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import genfn

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if "float32" not in formats:
        formats.insert(0, "float32")  # the reference for agreement
    rows = {}
    reference = None
    t0 = time.perf_counter()
    for fmt in formats:
        model = load(genfn, fmt)
        ids = model.tokenizer.encode(TEXT.read_text())
        input_ids, mask = batch_inputs(model.tokenizer, len(PROMPTS), 2)
        ppl = perplexity(model, ids)
        tokens = greedy(genfn, model, input_ids, mask, args.new_tokens)
        if fmt == "float32":
            reference = tokens
        same = tokens == reference
        # Tokens before the first difference, per row (all of them when none differs).
        prefix = torch.where(same.all(1), torch.full((len(same),), same.shape[1]), (~same).int().argmax(1))
        from genfn.models.quantized import weight_bytes

        rows[fmt] = dict(perplexity=ppl, agreement=same.float().mean().item(),
                         prefix_mean=prefix.float().mean().item(), weight_mb=weight_bytes(model.params) / 1e6,
                         text_tokens=len(ids))
        print(f"{fmt:9s} ppl {ppl:7.3f}  agreement {rows[fmt]['agreement']:6.1%}  "
              f"tokens before first difference {rows[fmt]['prefix_mean']:5.1f}/{args.new_tokens}  "
              f"{rows[fmt]['weight_mb']:5.0f} MB/token", flush=True)
        del model
        gc.collect()
    print(f"\n| format | MB/token | perplexity | vs float32 | greedy agreement | tokens before first difference |")
    print("|---|---|---|---|---|---|")
    base = rows["float32"]["perplexity"]
    for fmt, r in rows.items():
        print(f"| {fmt} | {r['weight_mb']:.0f} | {r['perplexity']:.3f} | {r['perplexity'] / base - 1:+.2%} | "
              f"{r['agreement']:.1%} | {r['prefix_mean']:.1f} / {args.new_tokens} |")
    print(f"\n# {len(PROMPTS)} prompts x {args.new_tokens} greedy tokens; text {rows['float32']['text_tokens']} tokens; "
          f"{time.perf_counter() - t0:.0f} s")
    out = write_results("quality", {"new_tokens": args.new_tokens, "prompts": len(PROMPTS), "rows": rows}, args.json)
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
