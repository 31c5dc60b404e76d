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

``--prompt open`` asks for text of the model's own (a poem) instead of a rewriting: most rounds
then find no earlier n-gram. ``--compare-wide`` then times the default and the strategy with every
round ``k + 1`` positions wide (``pick_step=None``: what genfn did before rounds without drafts ran
the one-token step) in alternating pairs, and adds the count of rounds that ran narrow, each
one's best round and the median of the pairs' decode-time ratio (narrow over wide).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import genfn  # noqa: E402
from assisted import prompts  # noqa: E402
from genfn.bench.decode import thread_meeting_ns  # noqa: E402
from genfn.generation import prepare_request  # noqa: E402

OPEN_PROMPT = "Write a short poem about autumn leaves and the wind."


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
    parser.add_argument("--prompt", choices=["copy", "open"], default="copy",
                        help="copy: rewrite a passage given in the prompt; open: a poem of the model's own")
    parser.add_argument("--compare-wide", action="store_true",
                        help="also time every round k + 1 positions wide (no one-token rounds)")
    parser.add_argument("--passes", type=int, default=1,
                        help="measure the step and every k this many times over, one line per k a pass (how "
                             "the VM's minutes move a round, which a single pass hides)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = genfn.load(quantize=args.quantize)
    if args.prompt == "copy":
        ids, mask = prompts(model.tokenizer, 1)
    else:
        chat = model.tokenizer.apply_chat_template([{"role": "user", "content": OPEN_PROMPT}],
                                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids, mask = chat["input_ids"], chat["attention_mask"]
    settings = dict(cache_implementation="static", max_cache_len=512, return_dict_in_generate=True)
    if not args.compiled:
        settings["disable_compile"] = True
    lines = []
    for pass_index in range(args.passes):
        lines += _one_pass(model, ids, mask, args, settings, pass_index)
    if args.out:
        with open(args.out, "w") as f:
            f.write("".join(json.dumps(line) + "\n" for line in lines))


def _one_pass(model, ids, mask, args, settings, pass_index: int) -> list[dict]:
    # One die or two: the few-row rounds pass cache lines between the threads at every meeting.
    meeting_ns = thread_meeting_ns()
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
        line = dict(k=k, pass_index=pass_index, prompt=args.prompt, compiled=args.compiled, weights="blocks" if args.quantize else "float32",
                    threads=torch.get_num_threads(), load_average=os.getloadavg()[0],
                    meeting_ns=None if meeting_ns is None else round(meeting_ns), prefill_s=round(prefill, 4),
                    step_ms=round(step * 1e3, 2), round_ms=round(round_s * 1e3, 2),
                    steps_per_round=round(round_s / step, 2),
                    tokens_per_round=round(out.acceptance["tokens_per_round"], 2),
                    decode_speedup=round((greedy - prefill) / (seconds - prefill), 2),
                    identical_to_greedy=bool(torch.equal(out.sequences, plain.sequences)))
        if args.compare_wide:
            line.update(_compare_wide(model, ids, mask, k, args.repeats, prefill, step, rounds, settings))
        print(json.dumps(line), flush=True)
        lines.append(line)
    return lines


def _compare_wide(model, ids, mask, k, repeats, prefill, step, rounds, settings) -> dict:
    """The same task with every round ``k + 1`` wide, timed in pairs with the default (which runs
    the rounds without drafts narrow): best of each, and the median of the pairs' decode-time ratio."""
    options = dict(settings, max_new_tokens=64, prompt_lookup_num_tokens=k)
    _, strategy = prepare_request(model, ids, attention_mask=mask, **options)
    picked = []

    def counting(state):
        chosen = strategy.pick_step(state)
        picked.append(chosen is not strategy.step)
        return chosen

    genfn.generate(model, ids, attention_mask=mask, strategy=dataclasses.replace(strategy, pick_step=counting),
                   **options)
    narrow_strategy, wide_strategy = strategy, dataclasses.replace(strategy, pick_step=None)
    genfn.generate(model, ids, attention_mask=mask, strategy=wide_strategy, **options)
    narrow, wide = [], []
    for _ in range(max(repeats, 5)):
        for times, chosen in ((narrow, narrow_strategy), (wide, wide_strategy)):
            start = time.perf_counter()
            genfn.generate(model, ids, attention_mask=mask, strategy=chosen, **options)
            times.append(time.perf_counter() - start - prefill)
    ratios = sorted(n / w for n, w in zip(narrow, wide))
    return dict(narrow_rounds=sum(picked), paired_narrow_round_ms=round(min(narrow) / rounds * 1e3, 2),
                paired_wide_round_ms=round(min(wide) / rounds * 1e3, 2),
                wide_steps_per_round=round(min(wide) / rounds / step, 2),
                narrow_over_wide_median=round(ratios[len(ratios) // 2], 3))


if __name__ == "__main__":
    main()
