"""``genfn determinism``: the determinism report (``genfn.determinism.check``) on a model, as a
table or one JSON object."""

from __future__ import annotations

import argparse
import json

from genfn.cli.common import UserError, add_model_arguments, integer, load_model, positive_int, read_text_file, \
    require_tokenizer
from genfn.cli.status import Status

__all__ = ["add_arguments", "main", "DEFAULT_PROMPTS"]

# Varied lengths and topics, so requests end at different steps and batches pad differently.
DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers larger than one hundred:",
    "Once upon a time, in a village at the edge of a forest, there lived",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "Q: What is the boiling point of water at sea level?\nA:",
    "A recipe for pancakes needs",
    "The three laws of thermodynamics are",
    "SELECT name, age FROM users WHERE",
    "Dear hiring manager, I am writing to apply for",
    "The most important idea in linear algebra is",
    "import torch\n\nclass MLP(torch.nn.Module):\n    def __init__(self",
    "Summarize the plot of Hamlet in one paragraph.",
    "Hi!",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="a text file with one prompt per line (default: 16 built-in prompts)")
    parser.add_argument("--num-prompts", type=positive_int, default=None, metavar="N",
                        help="use the first N prompts (the built-in ones repeat with a number when N > 16)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32)
    parser.add_argument("--do-sample", action="store_true", help="sample (request i uses the key of seed + i)")
    parser.add_argument("--seed", type=integer, default=0)
    parser.add_argument("--batch-sizes", default="4,16", metavar="N,N",
                        help="generate batch sizes to compare against running alone (default 4,16)")
    parser.add_argument("--cb-sizes", default=None, metavar="N,N",
                        help="continuous batching with at most N requests per forward, one manager per size "
                             "(default: one with room for every request)")
    parser.add_argument("--chunk-tokens", type=positive_int, default=16, metavar="N",
                        help="chunked prefill: prompt tokens per forward beside the decoding rows (default 16)")
    parser.add_argument("--threads", default="1,2", metavar="N,N",
                        help="torch thread counts to run the requests under (default 1,2)")
    parser.add_argument("--compile", action="store_true", help="also run the requests with the compiled step")
    parser.add_argument("--side-batch-size", type=positive_int, default=1, metavar="N",
                        help="run the --threads and --compile variants in generate batches of N instead of alone "
                             "(a long check's time is mostly its runs alone; default 1)")
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="skip the continuous-batching variant with prefix caching")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="run every variant in the batch-invariant mode (genfn.deterministic)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _prompts(args) -> list[str]:
    if args.prompts is not None:
        prompts = [line for line in read_text_file(args.prompts, "prompts file").splitlines() if line.strip()]
        if not prompts:
            raise UserError(f"the prompts file {args.prompts} holds no prompt")
    else:
        prompts = list(DEFAULT_PROMPTS)
    count = args.num_prompts or len(prompts)
    if args.prompts is not None and count > len(prompts):
        raise UserError(f"--num-prompts {count}: the prompts file holds {len(prompts)}")
    return [prompts[i % len(prompts)] + (f" ({i // len(prompts)})" if i >= len(prompts) else "")
            for i in range(count)]


def _int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(value < 1 for value in values):
        raise UserError(f"{flag} must be positive integers separated by commas, got {text!r}")
    return values


def _progress_line(name: str, seconds: float, comparison) -> str:
    if comparison is None:
        return f"{name}: {seconds:.0f} s"
    logit = "" if comparison.max_logit_diff is None else f", max |dlogit| {comparison.max_logit_diff:.3g}"
    return (f"{name}: {seconds:.0f} s, {comparison.identical}/{comparison.total} identical, first divergent tokens "
            f"{sorted(d.first_token for d in comparison.divergences)[:8] or '-'}, max |dlogprob| "
            f"{comparison.max_logprob_diff:.3g}{logit}")


def main(args, status: Status) -> int:
    from genfn.determinism import check

    prompts = _prompts(args)
    sizes = _int_list("--batch-sizes", args.batch_sizes)
    cb_sizes = None if args.cb_sizes is None else _int_list("--cb-sizes", args.cb_sizes)
    threads = _int_list("--threads", args.threads)
    model = load_model(args, status)
    require_tokenizer(model)
    status.begin(f"running {len(prompts)} prompts x {args.max_new_tokens} tokens in every variant")
    report = check(model, prompts, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, seed=args.seed,
                   batch_sizes=sizes, continuous_sizes=cb_sizes, chunk_tokens=args.chunk_tokens, threads=threads,
                   compiled=args.compile, side_batch_size=args.side_batch_size, prefix_cache=args.prefix_cache,
                   batch_invariant=args.batch_invariant,
                   progress=lambda name, seconds, comparison: status.line(_progress_line(name, seconds, comparison)))
    status.end("done")
    print(json.dumps(report.to_dict()) if args.json else report.format(), flush=True)
    return 0
