"""What a prompt-lookup verification round costs in plain decode steps, decode phase only.

    python benchmarks/lookup_rounds.py                      # SmolLM2 float32, eager, k = 7 and 10
    python benchmarks/lookup_rounds.py --compiled --quantize gguf --lookup-tokens 7,10,15

``benchmarks/assisted.py`` times whole ``generate`` calls, prefill included, so its speed-up mixes
the prompt's forward into both sides. Here, on the same rewriting task (batch 1, static cache, 64
new tokens, best of ``--repeats`` after a warm-up call each), the prefill alone (a 1-token call)
is subtracted: a plain step is (greedy - prefill) / 63, a round (prompt lookup - prefill) /
rounds. Prints per k: the step and round in ms, the round in plain steps, the tokens a round
yields, and the decode phase's speed-up. Issue 31's bar: a round costs at most ~1.33 steps
(the speed-up at least 0.75x the tokens per round). One JSON line per k; ``--out`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import genfn  # noqa: E402
from assisted import prompts  # noqa: E402


def best_call(model, ids, mask, repeats: int, **settings):
    genfn.generate(model, ids, attention_mask=mask, **settings)
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = genfn.generate(model, ids, attention_mask=mask, **settings)
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookup-tokens", default="7,10", help="comma-separated prompt_lookup_num_tokens")
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--quantize", choices=["gguf"], default=None, help="keep the file's blocks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = genfn.load(quantize=args.quantize)
    ids, mask = prompts(model.tokenizer, 1)
    settings = dict(cache_implementation="static", max_cache_len=512, return_dict_in_generate=True)
    if not args.compiled:
        settings["disable_compile"] = True
    prefill, _ = best_call(model, ids, mask, args.repeats, max_new_tokens=1, **settings)
    greedy, plain = best_call(model, ids, mask, args.repeats, max_new_tokens=64, **settings)
    new = plain.sequences.shape[1] - ids.shape[1]
    step = (greedy - prefill) / (new - 1)
    lines = []
    for k in (int(v) for v in args.lookup_tokens.split(",")):
        seconds, out = best_call(model, ids, mask, args.repeats, max_new_tokens=64, prompt_lookup_num_tokens=k,
                                 **settings)
        rounds = out.acceptance["total_rounds"]
        round_s = (seconds - prefill) / rounds
        line = dict(k=k, compiled=args.compiled, weights="blocks" if args.quantize else "float32",
                    threads=torch.get_num_threads(), load_average=os.getloadavg()[0], prefill_s=round(prefill, 4),
                    step_ms=round(step * 1e3, 2), round_ms=round(round_s * 1e3, 2),
                    steps_per_round=round(round_s / step, 2),
                    tokens_per_round=round(out.acceptance["tokens_per_round"], 2),
                    decode_speedup=round((greedy - prefill) / (seconds - prefill), 2),
                    identical_to_greedy=bool(torch.equal(out.sequences, plain.sequences)))
        print(json.dumps(line), flush=True)
        lines.append(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
