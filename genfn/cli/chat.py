"""``genfn chat``: an interactive conversation. Each turn the whole history is rendered again
through the model's chat template, so the model sees the conversation exactly as it was trained
to; ``/reset`` forgets it, ``/exit`` (or end of input, or Ctrl-C at the prompt) leaves.

With ``--tp N`` rank 0 reads standard input and hands every line to the other ranks, which run
each turn with it on their slices (rank 0 alone prints); Ctrl-C during a reply ends the chat, since
the ranks could not agree on where the interrupted reply stopped."""

from __future__ import annotations

import argparse
import sys

from genfn.cli.common import (UserError, add_model_arguments, load_model, may_compile, on_rank0, require_tokenizer,
                              sampling_defaults_flag, summary, tensor_shard)
from genfn.cli.generate import StatusStreamer, add_sampling_arguments, run_generation, sampling_settings
from genfn.cli.status import Status, watch_compiles

__all__ = ["add_arguments", "main", "COMMANDS"]

COMMANDS = {"/reset": "forget the conversation (the system message stays)", "/exit": "leave (also /quit, Ctrl-D)",
            "/help": "this list"}
_DEFAULT_CACHE_LEN = 2048


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_sampling_arguments(parser)
    parser.set_defaults(max_new_tokens=256)
    parser.add_argument("--sampling-defaults", type=sampling_defaults_flag, default="auto", metavar="SPEC",
                        help="the sampling settings no flag sets: 'auto' (the model's generation_config.json, else "
                             "temperature 0.7, top-p 0.95, top-k 50; as genfn serve), 'none' (greedy unless a "
                             "flag samples), or key=value pairs over auto, e.g. temperature=0.5,top_p=0.9")
    parser.add_argument("--max-cache-len", type=int, default=None,
                        help=f"with --compile: the static cache's length, one compiled step for every turn "
                             f"(default {_DEFAULT_CACHE_LEN})")


def _read_line(interactive: bool) -> str | None:
    """The next line the user typed; None at end of input."""
    if interactive:
        try:
            return input("> ")
        except EOFError:
            sys.stdout.write("\n")
            return None
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def _next_line(interactive: bool) -> str | None:
    """The next line, or None at end of input or Ctrl-C at the prompt (both leave)."""
    try:
        return _read_line(interactive)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return None


def main(args, status: Status) -> int:
    from genfn.serve.defaults import sampling_defaults

    sampling_settings(args)  # the flags, checked before the model loads
    if args.compile and args.max_cache_len is None:
        args.max_cache_len = _DEFAULT_CACHE_LEN
    args.num_beams = 1
    model = load_model(args, status)
    defaults = sampling_defaults(model.generation_config, args.sampling_defaults)
    settings = sampling_settings(args, defaults)
    if settings["do_sample"]:
        shown = ", ".join(f"{k} {settings[k]}" for k in ("temperature", "top_p", "top_k", "min_p") if k in settings)
        status.line(f"sampling ({shown or 'the model defaults'}; --temperature 0 is greedy)")
    tokenizer = require_tokenizer(model, chat=True, without_chat="genfn chat needs one (genfn generate does not)")
    # Under --tp, rank 0 reads the terminal and every rank gets each line: all run every turn alike.
    shard = tensor_shard(args)
    leader = shard is None or shard.rank == 0
    interactive = leader and bool(sys.stdin is not None and sys.stdin.isatty())
    if interactive:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        sys.stderr.write("genfn: chatting; /reset forgets the conversation, /exit leaves\n")
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    history: list[dict] = []
    with watch_compiles(status, compiles=may_compile(args, model)) as compile_s:
        while True:
            line = on_rank0(shard, lambda: _next_line(interactive))
            if line is None:
                return 0
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                command = text.split()[0].lower()
                if command in ("/exit", "/quit"):
                    return 0
                if command == "/reset":
                    history = []
                    status.line("conversation forgotten", always=True)
                elif command == "/help":
                    for name, what in COMMANDS.items():
                        status.line(f"{name}: {what}", always=True)
                else:
                    status.line(f"unknown command {command!r}; the commands are {', '.join(COMMANDS)}", always=True)
                continue
            turn = history + [{"role": "user", "content": text}]
            input_ids = tokenizer.apply_chat_template(system + turn, add_generation_prompt=True, return_tensors="pt")
            streamer = StatusStreamer(tokenizer, status, hold_first=args.compile)
            compiled_before = sum(compile_s)
            try:
                new_tokens, start, seconds = run_generation(model, input_ids, settings, args, streamer)
            except UserError as err:  # a turn generate refused (the conversation outgrew the context, say)
                status.line(f"error: {err}; /reset starts over", always=True)
                continue
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                if shard is not None:  # the ranks cannot agree where the reply stopped: the chat ends
                    raise
                status.line("reply interrupted; it is not kept in the conversation", always=True)
                continue
            reply = tokenizer.decode(new_tokens, skip_special_tokens=True)
            history = turn + [{"role": "assistant", "content": reply}]
            first = None if streamer.first_token_at is None else streamer.first_token_at - start
            compiled = sum(compile_s) - compiled_before
            summary(status, len(new_tokens), seconds, first, [compiled] if compiled else None,
                    tokens_at_first=streamer.tokens_at_first)
