"""``genfn generate``: one prompt in, its continuation streamed to stdout (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from genfn.cli.common import (UserError, add_model_arguments, integer, load_model, may_compile, number, positive_int,
                              read_text_file, require_tokenizer, summary)
from genfn.cli.status import Status, watch_compiles

__all__ = ["add_arguments", "main", "add_sampling_arguments", "sampling_settings", "check_settings",
           "StatusStreamer", "finish_reason", "response_format"]


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--do-sample", action="store_true",
                        help="sample instead of greedy decoding (implied by --temperature > 0, --top-p, --top-k, "
                             "--min-p)")
    parser.add_argument("--temperature", type=number, default=None, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=number, default=None, help="nucleus sampling: keep this much probability")
    parser.add_argument("--top-k", type=integer, default=None, help="keep the k most likely tokens (0: all)")
    parser.add_argument("--min-p", type=number, default=None,
                        help="drop tokens less likely than this fraction of the most likely one")
    parser.add_argument("--repetition-penalty", type=number, default=None,
                        help="divide the logits of tokens already present by this (> 1 repeats less)")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="stop when the text contains TEXT (repeatable)")
    parser.add_argument("--seed", type=integer, default=0, help="seed of the sampling key (default 0)")
    parser.add_argument("--system", default=None, help="a system message (implies --chat)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the decode step against a static cache (slow first call, fast decoding)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None,
                        help="the prompt text; '-' or no prompt with piped input reads standard input")
    parser.add_argument("--file", "--prompt-file", dest="prompt_file", default=None, metavar="PATH",
                        help="read the prompt from this file ('-': standard input)")
    add_model_arguments(parser)
    add_sampling_arguments(parser)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--num-beams", type=positive_int, default=1, help="beam search with this many beams "
                                                                          "(the text is printed at the end)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (prompt, text, tokens, finish_reason, timings) instead of text")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", default=None, metavar="FILE",
                            help="constrain the output to JSON matching the JSON schema in FILE")
    constraint.add_argument("--regex", default=None, metavar="PATTERN", help="constrain the output to match PATTERN")
    constraint.add_argument("--grammar", default=None, metavar="FILE",
                            help="constrain the output to the grammar in FILE (Lark; GBNF/EBNF when FILE ends in "
                                 ".gbnf or .ebnf)")


def response_format(args) -> dict | None:
    """The ``response_format`` of --json-schema / --regex / --grammar, or None."""
    if getattr(args, "json_schema", None):
        text = read_text_file(args.json_schema, "the JSON schema file")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"--json-schema {args.json_schema} is not valid JSON: {err}") from None
        return {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
    if getattr(args, "regex", None) is not None:
        return {"type": "regex", "pattern": args.regex}
    if getattr(args, "grammar", None):
        syntax = "ebnf" if args.grammar.endswith((".gbnf", ".ebnf")) else "lark"
        return {"type": "grammar", "syntax": syntax, "grammar": read_text_file(args.grammar, "the grammar file")}
    return None


def sampling_settings(args, defaults: dict | None = None) -> dict:
    """``generate`` keyword arguments of the sampling flags, checked (a UserError naming the flag)
    before any model loads. A sampling flag implies sampling (as llama.cpp's do); ``--temperature 0``
    is greedy. ``defaults`` (``genfn chat``'s sampling defaults) fill the sampling settings no flag
    sets, and sample when no flag says otherwise."""
    flags = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
             "min_p": getattr(args, "min_p", None)}
    sampling = {k: v for k, v in flags.items() if v is not None}
    if sampling.get("temperature") == 0 and args.do_sample:
        raise UserError("--do-sample with --temperature 0 contradict each other (temperature 0 is greedy)")
    check_settings({**{k: v for k, v in sampling.items() if v != 0 or k != "temperature"}, "do_sample": True})
    do_sample = args.do_sample or any(v for k, v in sampling.items() if k != "temperature") \
        or (sampling.get("temperature") or 0) > 0
    if sampling.get("temperature") == 0:
        do_sample = False
    elif defaults and not args.do_sample and not sampling:
        do_sample = (defaults.get("temperature") or 0) > 0 or "temperature" not in defaults
    if do_sample and defaults:
        sampling = {**{k: defaults[k] for k in flags if defaults.get(k) is not None}, **sampling}
    if not do_sample:
        sampling = {}
    settings = dict(sampling, max_new_tokens=args.max_new_tokens, do_sample=do_sample)
    penalty = args.repetition_penalty
    if penalty is None and defaults and defaults.get("repetition_penalty") not in (None, 1.0):
        penalty = defaults["repetition_penalty"]
    if penalty is not None:
        settings["repetition_penalty"] = penalty
    if args.stop:
        if any(not text for text in args.stop):
            raise UserError("--stop needs a non-empty text")
        settings["stop_strings"] = list(args.stop)
    check_settings(settings)
    return settings


def check_settings(settings: dict, where: str = "") -> None:
    """``GenerationConfig``'s own checks of ``settings`` (one set of rules for the library and the
    CLI), as a UserError naming the flag."""
    from genfn.config import GenerationConfig

    checked = {k: v for k, v in settings.items() if k != "stop_strings"}
    try:
        GenerationConfig(**checked)
    except (ValueError, TypeError) as err:
        text = str(err)
        for name in checked:
            text = text.replace(f"`{name}`", f"--{name.replace('_', '-')}" if not where else f"'{name}'")
        raise UserError(f"{where}{text}") from None


def read_prompt(args) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise UserError("give the prompt as an argument or with --file, not both")
    source = args.prompt_file
    if source is None and args.prompt == "-":
        source = "-"
    if source is None and args.prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise UserError("no prompt: give it as an argument, with --file PATH, or on standard input")
        source = "-"
    text = args.prompt if source is None else read_text_file(source, "prompt file")
    if not text.strip():
        if source == "-" and args.prompt_file is None and args.prompt is None:
            raise UserError("no prompt: give it as an argument, with --file PATH, or on standard input")
        raise UserError("the prompt is empty")
    return text


class StatusStreamer:
    """The tokens ``generate`` streams, as text on stdout, with the timing the summary reports.

    ``hold_first``: keep the prefill's token until the first decode step returns, so that the
    step's compilation (a status phase on stderr) finishes before any text starts its line."""

    def __init__(self, tokenizer, status: Status, *, show: bool = True, hold_first: bool = False):
        from genfn.streamers import TextStreamer

        self.status = status
        self.text = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if show else None
        self.hold_first = hold_first
        self._held: list = []
        self._seen_prompt = False
        self.tokens = 0
        self.first_token_at: float | None = None
        self.tokens_at_first = 0  # tokens shown at that moment (two when the first was held)

    def put(self, value) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            if self.text is not None:
                self.text.put(value)
            return
        self.tokens += int(value.numel())
        if self.hold_first and not self._held and self.first_token_at is None:
            self._held.append(value)
            return
        self._release(value)

    def _release(self, value=None) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            self.tokens_at_first = self.tokens
            self.status.text_open = self.text is not None
        for held in self._held + ([value] if value is not None else []):
            if self.text is not None:
                self.text.put(held)
        self._held = []

    def end(self) -> None:
        if self._held:
            self._release()
        if self.text is not None and self._seen_prompt:
            self.text.end()
        self.status.text_open = False
        self._seen_prompt = False

    def fail(self, error: BaseException) -> None:
        self._held = []
        if self.text is not None and self.first_token_at is not None:
            self.text.end()  # finish the line already printed
        self.status.text_open = False
        self._seen_prompt = False


def finish_reason(new_tokens: list[int], text: str, max_new_tokens: int, eos_ids, stop) -> str:
    """OpenAI's two reasons: ``length`` when the token budget ran out, ``stop`` otherwise."""
    if len(new_tokens) < max_new_tokens or (new_tokens and new_tokens[-1] in eos_ids):
        return "stop"
    if stop and any(s in text for s in stop):
        return "stop"
    return "length"


def eos_ids(model) -> set:
    from genfn.resolve import stop_token_ids

    return set(stop_token_ids(model.generation_config, model.tokenizer))


def encode_prompt(tokenizer, prompt: str, chat: bool, system: str | None):
    if chat or system is not None:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
                   [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return tokenizer([prompt])["input_ids"]


def run_generation(model, input_ids, settings: dict, args, streamer: StatusStreamer | None):
    """``genfn.generate`` with the CLI's flags; returns (new token ids, start time, seconds)."""
    import genfn

    extra = {"cache_implementation": "static"} if args.compile else {}
    if getattr(args, "max_cache_len", None):
        extra["max_cache_len"] = args.max_cache_len
    if "stop_strings" in settings or "response_format" in settings:
        extra["tokenizer"] = model.tokenizer
    if args.num_beams > 1:
        extra["num_beams"] = args.num_beams
    start = time.perf_counter()
    try:
        out = genfn.generate(model, input_ids, key=genfn.random.key(args.seed), streamer=streamer, **settings,
                             **extra)
    except (ValueError, TypeError) as err:  # generate validates every setting and names it
        raise UserError(str(err)) from None
    return out[0, input_ids.shape[1]:].tolist(), start, time.perf_counter() - start


def main(args, status: Status) -> int:
    if args.system is not None:
        args.chat = True
    prompt = read_prompt(args)
    settings = sampling_settings(args)
    constraint = response_format(args)
    if constraint is not None:
        settings["response_format"] = constraint
    if args.num_beams > 1 and args.do_sample:
        raise UserError("--num-beams with --do-sample (beam sampling) is not offered by the CLI; pick one")
    load_start = time.perf_counter()
    model = load_model(args, status)
    load_s = time.perf_counter() - load_start
    tokenizer = require_tokenizer(model, chat=args.chat)
    input_ids = encode_prompt(tokenizer, prompt, args.chat, args.system)
    streamer = None
    if args.num_beams == 1:  # beam search keeps several hypotheses: nothing is final until the end
        streamer = StatusStreamer(tokenizer, status, show=not args.json, hold_first=args.compile)
    elif not args.json:
        status.line(f"beam search with {args.num_beams} beams: the text is printed when it is done")
    with watch_compiles(status, compiles=may_compile(args, model)) as compile_s:
        new_tokens, start, seconds = run_generation(model, input_ids, settings, args, streamer)
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    if streamer is None and not args.json:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    first_token_s = None if streamer is None or streamer.first_token_at is None else streamer.first_token_at - start
    reason = finish_reason(new_tokens, text, args.max_new_tokens, eos_ids(model), args.stop)
    if args.json:
        timings = {"load_s": round(load_s, 4), "first_token_s": None if first_token_s is None else round(first_token_s, 4),
                   "generate_s": round(seconds, 4), "compile_s": round(sum(compile_s), 4),
                   "tokens_per_s": round(len(new_tokens) / seconds, 3) if seconds > 0 else None}
        json.dump({"prompt": prompt, "text": text, "tokens": new_tokens, "finish_reason": reason,
                   "timings": timings}, sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
        sys.stdout.flush()
    summary(status, len(new_tokens), seconds, first_token_s, compile_s,
            tokens_at_first=streamer.tokens_at_first if streamer is not None else 1)
    return 0
