"""Where prompt lookup's time goes inside continuous batching: forwards, their tokens, their time.

    python benchmarks/lookup_forwards.py                       # float32, k = 4, 8 copy requests x 256
    python benchmarks/lookup_forwards.py --dtype bfloat16 --prompt-lookup-tokens 8 --requests 16

Runs ``generate_batch`` on the copy workload of ``benchmarks/batching.py`` (SmolLM2-135M, greedy,
every request decoding ``--new-tokens``), without and with ``prompt_lookup_num_tokens``, in
alternation (``--rounds`` each), timing every packed forward of the engine. A forward whose
tokens all give logits is a decode forward (one token a row, plus a speculative row's drafts);
the others carry prompt tokens. Prints, per run, the wall time, the decode forwards and their
time, the forwards that carried prompt tokens and theirs, and the decode forwards' mean time by
token count; then the decode-phase and end-to-end speedups. Speculation can only shorten the
decode phase: the prefill is the same work in both runs, so the end-to-end ratio is the decode
ratio diluted by the prefill's share of the wall time.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import genfn  # noqa: E402
from genfn.batching import engine as batching_engine  # noqa: E402
from genfn.bench.results import write_results  # noqa: E402
from genfn.bench.workloads import copy_prompts  # noqa: E402
from genfn.default_model import default_model_path  # noqa: E402


class ForwardTimer:
    """Wraps the engine's forward for the life of the run, recording (tokens, logits entries, seconds)."""

    def __init__(self):
        self.records: list[tuple[int, int, float]] = []
        self._forward = batching_engine.Engine.forward
        timer = self

        def timed(engine, inputs, plan=None):
            start = time.perf_counter()
            out = timer._forward(engine, inputs, plan)
            timer.records.append((int(inputs.input_ids.shape[0]), int(inputs.logits_index.shape[0]),
                                  time.perf_counter() - start))
            return out

        batching_engine.Engine.forward = timed

    def take(self) -> list[tuple[int, int, float]]:
        records, self.records = self.records, []
        return records


def summarize(records, wall: float) -> dict:
    decode = [r for r in records if r[0] <= r[1]]
    prefill = [r for r in records if r[0] > r[1]]
    by_tokens = collections.defaultdict(list)
    for tokens, _, seconds in decode:
        by_tokens[tokens].append(seconds)
    return {"wall_s": wall, "decode_forwards": len(decode), "decode_s": sum(r[2] for r in decode),
            "prefill_forwards": len(prefill), "prefill_s": sum(r[2] for r in prefill),
            "decode_ms_by_tokens": {n: 1000 * sum(v) / len(v) for n, v in sorted(by_tokens.items())},
            "decode_count_by_tokens": {n: len(v) for n, v in sorted(by_tokens.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--copy-chars", type=int, default=1200)
    parser.add_argument("--prompt-lookup-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tag", default=None)
    args = parser.parse_args()

    model = genfn.load(default_model_path(), dtype=getattr(torch, args.dtype))
    prompts = copy_prompts(model.tokenizer, args.requests, args.copy_chars)
    timer = ForwardTimer()
    print(f"# prompt lookup in continuous batching: {args.requests} copy requests x {args.new_tokens}, {args.dtype}, "
          f"k={args.prompt_lookup_tokens}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    runs = []
    for _ in range(args.rounds):
        for lookup in (None, args.prompt_lookup_tokens):
            settings = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
            if lookup:
                settings["prompt_lookup_num_tokens"] = lookup
            timer.take()
            start = time.perf_counter()
            model.generate_batch(prompts, **settings)
            run = dict(summarize(timer.take(), time.perf_counter() - start), lookup=lookup)
            runs.append(run)
            print(f"lookup={lookup}: wall {run['wall_s']:.1f} s; decode {run['decode_forwards']} forwards "
                  f"{run['decode_s']:.1f} s; with prompt tokens {run['prefill_forwards']} forwards {run['prefill_s']:.1f} s")
            print("    decode forwards, ms by tokens: " + ", ".join(
                f"{n}:{ms:.0f} (x{run['decode_count_by_tokens'][n]})" for n, ms in run["decode_ms_by_tokens"].items()))
    plain = [r for r in runs if not r["lookup"]]
    spec = [r for r in runs if r["lookup"]]
    decode = min(r["decode_s"] for r in plain) / min(r["decode_s"] for r in spec)
    wall = min(r["wall_s"] for r in plain) / min(r["wall_s"] for r in spec)
    print(f"speedup (best of {args.rounds} each): decode phase {decode:.2f}x, end to end {wall:.2f}x")
    report = dict(args=vars(args), runs=runs, decode_speedup=decode, end_to_end_speedup=wall, load_average=os.getloadavg())
    print(f"# wrote {write_results('lookup-forwards', report, tag=args.tag)}")


if __name__ == "__main__":
    main()
