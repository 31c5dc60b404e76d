"""Assisted (speculative) decoding on SmolLM2-135M: plain greedy against each proposer, in one run.

    python benchmarks/assisted.py                  # eager, static cache, 64 new tokens
    python benchmarks/assisted.py --compiled       # the compiled step (minutes of compiling per engine on CPU)
    python benchmarks/assisted.py --quick          # 32 new tokens, one timed repeat
    python benchmarks/assisted.py --engines prompt-lookup --repeats 3   # greedy vs prompt lookup only
    python benchmarks/assisted.py --engines prompt-lookup --quantize gguf   # the file's Q4_1 blocks kept
    python benchmarks/assisted.py --engines greedy prompt-lookup --dynamic-cache   # generate's default cache

The task is input-grounded: the model rewrites a passage given in the prompt (chat template), so
its output copies long spans of the prompt, which is where prompt lookup drafts well. Engines
(all greedy, static cache, or with ``--dynamic-cache`` the growing cache ``generate`` keeps by default,
eager; each compared token for token with plain greedy of the same batch):

    greedy         plain greedy decoding (the baseline)
    prompt-lookup  prompt_lookup_num_tokens (drafts from the row's own tokens; no draft model)
    early-exit     assistant_early_exit (the first N of 30 layers draft, sharing the cache)
    draft-bf16     assistant_model = a bfloat16 copy of the same model (num_assistant_tokens)

Batch 1 runs every engine; batch 4 (four passages of different lengths, left padded) runs greedy
and prompt lookup. Prints and writes (benchmarks/results/assisted-<date>.json) tok/s (best of
``--repeats``, engines interleaved within each repeat; with ``--compiled`` after a warm-up call
that compiles), the speed-up over greedy, whether the tokens equal greedy's, and the acceptance
statistics. A slow-down is reported as one.
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import datetime
import json

import torch

import genfn  # noqa: E402

from genfn.bench.results import write_results  # noqa: E402
from genfn.bench.timing import interleaved  # noqa: E402

PASSAGES = [
    "The town council met on Tuesday evening to discuss the new library. After a long debate, the members "
    "agreed that the library will open in the spring, once the repairs to the roof are finished. The old "
    "building on Main Street will become a community centre with rooms for classes and meetings.",
    "Honey bees live in colonies of many thousands. Each colony has one queen, who lays the eggs, a few "
    "hundred male drones, and thousands of female workers. The workers collect nectar and pollen, build "
    "the wax comb, feed the young and defend the hive.",
    "To reset the router, unplug it from the power socket and wait for thirty seconds. Then plug it back "
    "in and wait until the green light stops blinking. If the light stays red, hold the reset button for "
    "ten seconds and set up the network again.",
    "The river flooded the lower fields twice this year. Farmers moved their animals to the hills and "
    "waited for the water to go down. The government has promised money to repair the damaged roads and "
    "bridges before the winter.",
]
INSTRUCTION = "Rewrite the following passage in clear, simple English. Keep every fact.\n\n"


def prompts(tokenizer, count: int):
    conversations = [[{"role": "user", "content": INSTRUCTION + passage}] for passage in PASSAGES[:count]]
    batch = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)
    return batch["input_ids"], batch["attention_mask"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--lookup-tokens", type=int, default=10)
    parser.add_argument("--early-exit", type=int, default=8)
    parser.add_argument("--assistant-tokens", type=int, default=4)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--dynamic-cache", action="store_true",
                        help="generate's default growing cache (eager) instead of a static one")
    parser.add_argument("--quantize", choices=["gguf"], default=None,
                        help="keep the file's Q4_1/Q8_0 blocks (genfn.load(quantize='gguf')) instead of float32")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4], choices=[1, 2, 3, 4])
    parser.add_argument("--engines", nargs="+", default=["greedy", "prompt-lookup", "early-exit", "draft-bf16"],
                        help="which engines to run (greedy, the baseline, always runs)")
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. the machine's load)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.repeats = 32, 1

    model = genfn.load(quantize=args.quantize)
    draft = genfn.load(dtype=torch.bfloat16) if "draft-bf16" in args.engines else None
    weights = "its Q4_1/Q8_0 blocks kept" if args.quantize else "dequantized to float32"
    if args.dynamic_cache and args.compiled:
        parser.error("--dynamic-cache runs eagerly: it does not combine with --compiled")
    settings = dict(max_new_tokens=args.new_tokens, return_dict_in_generate=True)
    if not args.dynamic_cache:
        settings.update(cache_implementation="static", max_cache_len=512)
    if not args.compiled and not args.dynamic_cache:
        settings["disable_compile"] = True
    engines = {
        "greedy": {},
        "prompt-lookup": dict(prompt_lookup_num_tokens=args.lookup_tokens),
        "early-exit": dict(assistant_early_exit=args.early_exit, num_assistant_tokens=args.assistant_tokens,
                           assistant_confidence_threshold=0.0),
        "draft-bf16": dict(assistant_model=draft, num_assistant_tokens=args.assistant_tokens,
                           assistant_confidence_threshold=0.0),
    }
    args.engines = ["greedy"] + [name for name in args.engines if name != "greedy"]
    plan = {batch: list(engines) if batch == 1 else ["greedy", "prompt-lookup"] for batch in args.batches}
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "model": f"SmolLM2-135M-Instruct (Q4_1 GGUF, {weights})", "torch": torch.__version__,
               "threads": torch.get_num_threads(), "compiled": args.compiled, "new_tokens": args.new_tokens,
               "settings": {k: v for k, v in vars(args).items() if k != "out"},
               "load_average_at_start": os.getloadavg(), "runs": []}
    print(f"# assisted decoding, SmolLM2-135M ({weights}), {args.new_tokens} new tokens, "
          f"{'compiled' if args.compiled else 'eager'}, {torch.get_num_threads()} threads")
    for batch, names in plan.items():
        ids, mask = prompts(model.tokenizer, batch)
        baseline = None
        calls = {name: (lambda name=name: genfn.generate(model, ids, attention_mask=mask, **settings,
                                                        **engines[name])) for name in names if name in args.engines}
        for name, (out, times) in interleaved(calls, args.repeats, args.compiled).items():
            seconds = min(times)
            tokens = batch * (out.sequences.shape[1] - ids.shape[1])  # the same for every engine of a batch
            row = {"batch": batch, "engine": name, "seconds": round(seconds, 3),
                   "tok_per_s": round(tokens / seconds, 2), "all_seconds": [round(t, 2) for t in times]}
            if baseline is None:
                baseline = (out.sequences, seconds)
            else:
                row["speedup_vs_greedy"] = round(baseline[1] / seconds, 2)
                row["identical_to_greedy"] = bool(torch.equal(out.sequences, baseline[0]))
            acceptance = getattr(out, "acceptance", None)
            if acceptance is not None:
                row.update(acceptance_rate=round(acceptance["acceptance_rate"], 3),
                           tokens_per_round=round(acceptance["tokens_per_round"], 2),
                           proposed=acceptance["total_proposed"], accepted=acceptance["total_accepted"],
                           rounds=acceptance["total_rounds"])
            results["runs"].append(row)
            print(json.dumps(row))
        if batch == 1:
            text = model.tokenizer.decode(baseline[0][0, ids.shape[1]:], skip_special_tokens=True)
            results["sample_output"] = text
            print("# greedy output:", text.replace("\n", " ")[:300])
    print("# wrote", write_results("assisted", results, args.out, indent=2))


if __name__ == "__main__":
    main()
