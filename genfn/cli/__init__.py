"""The ``genfn`` command line: ``generate``, ``chat``, ``batch``, ``bench``, ``serve``, ``determinism`` and ``kernels``.

Status lines (loading, kernel build, compiling, a closing tokens/s summary) go to stderr and
``--quiet`` hides them; generated text goes to stdout. A user's mistake (a bad flag value, a
missing or broken model, a missing prompt file) ends the command with one line on stderr,
``genfn: error: ...``, and exit status 2; Python warnings are shown as one-line
``genfn: warning: ...`` messages (genfn's own; everyone's with ``--verbose``), never as
tracebacks or warning source lines.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
import warnings

from genfn.cli import batch, bench, chat, determinism, generate, kernels, serve
from genfn.cli.common import GENFN_DIR, USER_ERROR, Parser, StderrLines, UserError
from genfn.cli.status import Status

__all__ = ["main", "UserError", "USER_ERROR"]

logger = logging.getLogger("genfn")

_COMMANDS = {
    "generate": (generate, "generate text from a prompt, streaming it to stdout"),
    "chat": (chat, "an interactive chat with the model (/reset, /exit)"),
    "batch": (batch, "run a JSON-lines file of prompts with continuous batching (resumable)"),
    "bench": (bench, "run the decode benchmark (python -m genfn.bench) and plot tokens/s per configuration"),
    "determinism": (determinism, "run the same prompts alone, batched and continuously batched; report what differs"),
    "serve": (serve, "the OpenAI-compatible HTTP server and web page (the 'serve' extra)"),
    "kernels": (kernels, "where the native kernels are (status), or build them now (build)"),
}


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("genfn")
    except metadata.PackageNotFoundError:  # a source checkout that was never installed
        return "0.1.0 (not installed)"


def _command_of(argv: list[str]) -> str | None:
    for word in argv:
        if not word.startswith("-"):
            return word
    return None


def _parser(argv: list[str]) -> argparse.ArgumentParser:
    # -v/-q before or after the command name: the sub-parsers' copies default to SUPPRESS so they
    # never overwrite what the main parser read.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show every warning and log message")
    common.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="no status lines on stderr (errors and warnings still show)")
    parser = Parser(prog="genfn", description="Functional text generation for PyTorch models.")
    parser.add_argument("--version", action="version", version=f"genfn {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every warning and log message")
    parser.add_argument("-q", "--quiet", action="store_true", help="no status lines on stderr")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    wanted = _command_of(argv)
    parser.commands = {}
    for name, (module, help_text) in _COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text, parents=[common])
        parser.commands[name] = sub
        if name == "serve" and wanted != "serve":
            continue  # its options come from genfn.serve, imported only for `genfn serve`
        module.add_arguments(sub)
    return parser


def _unknown_arguments(extras: list[str], parser: argparse.ArgumentParser, command: str | None) -> str:
    """The error for arguments no option takes, suggesting the closest option for each flag."""
    sub = getattr(parser, "commands", {}).get(command)
    options = sorted({*parser._option_string_actions, *(sub._option_string_actions if sub is not None else ())})
    hints = []
    for word in extras:
        if not word.startswith("-"):
            continue
        close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.6)
        if close:
            hints.append(f"{word.split('=', 1)[0]}: did you mean {close[0]}?")
    where = f"genfn {command}" if command else "genfn"
    text = f"unrecognized arguments: {' '.join(extras)}"
    if hints:
        text += " (" + "; ".join(hints) + ")"
    return f"{text} (see `{where} --help`)"


def _show_warning(verbose: bool):
    def show(message, category, filename, lineno, file=None, line=None):
        ours = os.path.abspath(filename).startswith(GENFN_DIR)
        level = logging.WARNING if ours or verbose else logging.DEBUG
        logger.log(level, "%s", message)
    return show


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    status = Status()
    handler = StderrLines(status)
    saved = (warnings.showwarning, logger.level, logger.propagate)
    try:
        parser = _parser(argv)
        args, extras = parser.parse_known_args(argv)
        if extras:
            raise UserError(_unknown_arguments(extras, parser, getattr(args, "command", None)))
        status.quiet = args.quiet
        handler.verbose = args.verbose
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO)
        logger.propagate = False
        warnings.showwarning = _show_warning(args.verbose)
        module, _ = _COMMANDS[args.command]
        if getattr(args, "tp", 1) > 1:
            from genfn.distributed import run_command

            if args.command not in ("generate", "serve", "chat", "batch"):
                raise UserError(f"--tp is supported by `genfn generate`, `chat`, `batch` and `serve`, not by "
                                f"`genfn {args.command}`")
            if args.command == "generate" and ("-" in (args.prompt_file, args.prompt)
                                               or (args.prompt is None and args.prompt_file is None)):
                raise UserError("--tp reads the prompt from the command line or --file on every rank, "
                                "not from standard input")

            return run_command(args.tp, argv,
                               lambda rank: module.main(args, status if rank == 0 else Status(silent=True)))
        return module.main(args, status)
    except UserError as err:
        status.close()
        print(f"genfn: error: {err}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        status.close()
        print("\ngenfn: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (`genfn generate ... | head`): stop quietly, and keep Python's exit-time
        # flush of stdout from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        status.close()
        logger.removeHandler(handler)
        warnings.showwarning, level, logger.propagate = saved[0], saved[1], saved[2]
        logger.setLevel(level)
