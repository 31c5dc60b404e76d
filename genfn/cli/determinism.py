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
    parser.add_argument("--compile", action="store_true", help="also run each request alone with the compiled step")
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


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(size < 1 for size in sizes):
        raise UserError(f"--batch-sizes must be positive integers separated by commas, got {text!r}")
    return sizes


def main(args, status: Status) -> int:
    from genfn.determinism import check

    prompts = _prompts(args)
    sizes = _batch_sizes(args.batch_sizes)
    model = load_model(args, status)
    require_tokenizer(model)
    status.begin(f"running {len(prompts)} prompts x {args.max_new_tokens} tokens in every variant")
    report = check(model, prompts, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, seed=args.seed,
                   batch_sizes=sizes, compiled=args.compile, batch_invariant=args.batch_invariant)
    status.end("done")
    print(json.dumps(report.to_dict()) if args.json else report.format(), flush=True)
    return 0
