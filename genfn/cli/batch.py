"""``genfn batch INPUT.jsonl OUTPUT.jsonl``: many prompts through continuous batching, resumable.

Each input line is a JSON object: ``prompt`` (text) or ``messages`` (a chat, rendered with the
model's template), and optionally ``id``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty``, ``seed``, ``stop``, ``prompt_lookup_num_tokens`` (prompt-lookup
speculation: the same output in fewer steps when the answer copies the prompt), ``do_sample`` (a positive
``temperature``, ``top_p`` or ``top_k`` samples unless ``do_sample`` is false), ``num_beams``,
``length_penalty``, ``early_stopping`` (beam search, the best hypothesis written, with its
``sequence_score``) and
``response_format`` (structured output: ``{"type": "json_schema", "json_schema": {"schema": ...}}``,
``{"type": "regex", "pattern": ...}``, ... as ``generate`` takes it), and ``generate``'s
``guidance_scale`` (with ``negative_prompt_ids``, token ids), ``watermarking_config`` (an object;
SynthID when it has ``ngram_len``) and ``token_healing``. Each finished
request is appended to OUTPUT at once (``id``, ``text``, ``tokens``, ``finish_reason``) as one whole
line, flushed and fsync'd, so a run that stops part way (even SIGKILL) loses nothing it reported:
run the same command again and the ids already in OUTPUT are skipped, and a last line cut short is
dropped and written again. ``--ordered`` writes the results in input order (a result waits for
the ones before it). A line without ``id`` is known by its line number (``line-7``).

Every line is read and its settings checked (by ``GenerationConfig``'s own rules) before the model
loads: a bad line refuses the file, naming the line, or with ``--skip-bad`` is skipped and listed
at the end (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from genfn.cli.common import (UserError, add_model_arguments, load_model, on_rank0, positive_int, read_text_file,
                              require_tokenizer, tensor_shard)
from genfn.cli.generate import check_settings, eos_ids, finish_reason
from genfn.cli.status import Status, watch_compiles
from genfn.config.response_format import check_response_format

__all__ = ["add_arguments", "main", "read_requests", "read_done_ids", "BatchRequest", "ResultWriter"]

_FIELDS = {"id", "prompt", "messages", "max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "min_p",
           "repetition_penalty", "seed", "stop", "do_sample", "response_format", "num_beams", "length_penalty",
           "early_stopping", "prompt_lookup_num_tokens", "guidance_scale", "negative_prompt_ids",
           "watermarking_config", "token_healing"}
_RESULT_WAIT_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="JSON lines, one request each")
    parser.add_argument("output", help="JSON lines, one result each; appended to, and read to resume")
    add_model_arguments(parser)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128,
                        help="for lines without max_tokens (default 128)")
    parser.add_argument("--max-requests", type=positive_int, default=None,
                        help="requests decoded together at most (default: sized from the inputs)")
    parser.add_argument("--ordered", action="store_true",
                        help="write the results in input order (default: as they finish)")
    parser.add_argument("--skip-bad", action="store_true",
                        help="skip input lines with bad JSON or settings and list them at the end (default: a bad "
                             "line refuses the file)")


class BatchRequest:
    """One input line: its id, the prompt (text or chat), its token ids once encoded, and the
    request's own settings."""

    def __init__(self, request_id: str, line: int, prompt, max_new_tokens: int, settings: dict, stop):
        self.request_id, self.line, self.prompt = request_id, line, prompt
        self.ids: list[int] = []
        self.max_new_tokens, self.settings, self.stop = max_new_tokens, settings, stop

    def encode(self, tokenizer) -> None:
        if isinstance(self.prompt, str):
            self.ids = tokenizer([self.prompt])["input_ids"][0].tolist()
            return
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"input line {self.line} has 'messages', but the model has no chat template")
        ids = list(tokenizer.apply_chat_template(self.prompt, add_generation_prompt=True))
        self.ids = ids[0] if ids and isinstance(ids[0], list) else ids


def _number(value, name: str, line: int, integer: bool = False):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise UserError(f"input line {line}: {name!r} must be {'an integer' if integer else 'a number'}, "
                        f"got {json.dumps(value)}")
    return value


def _settings(record: dict, line: int, default_max: int) -> tuple[int, dict, list | None]:
    max_new = record.get("max_tokens", record.get("max_new_tokens", default_max))
    if _number(max_new, "max_tokens", line, integer=True) <= 0:
        raise UserError(f"input line {line}: 'max_tokens' must be positive, got {max_new}")
    settings: dict = {}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "length_penalty"):
        if name in record:
            settings[name] = float(_number(record[name], name, line))
    if "early_stopping" in record:
        if record["early_stopping"] not in (True, False, "never"):
            raise UserError(f"input line {line}: 'early_stopping' must be true, false or \"never\"")
        settings["early_stopping"] = record["early_stopping"]
    for name in ("top_k", "seed", "num_beams", "prompt_lookup_num_tokens"):
        if name in record:
            settings[name] = _number(record[name], name, line, integer=True)
    given = {k: v for k, v in settings.items() if k != "seed" and not (k == "temperature" and v == 0)}
    check_settings({**given, "do_sample": True}, where=f"input line {line}: ")  # every value, sampled or not
    samples = settings.get("temperature", 0) > 0 or "top_p" in settings or settings.get("top_k", 0) > 0
    if "do_sample" in record:
        if not isinstance(record["do_sample"], bool):
            raise UserError(f"input line {line}: 'do_sample' must be true or false")
        samples = record["do_sample"]
    if settings.get("temperature") == 0:
        del settings["temperature"]  # OpenAI's "temperature 0" means greedy
    if not samples:
        for name in ("temperature", "top_p", "top_k", "min_p"):
            settings.pop(name, None)
    settings["do_sample"] = samples
    check_settings({k: v for k, v in settings.items() if k != "seed"}, where=f"input line {line}: ")
    settings.update(_generate_settings(record, line))
    stop = record.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not stop or not all(isinstance(s, str) and s for s in stop):
            raise UserError(f"input line {line}: 'stop' must be a non-empty string or list of them")
        settings["stop_strings"] = stop
    if record.get("response_format") is not None:
        try:
            check_response_format("response_format", record["response_format"])
        except (ValueError, TypeError) as err:
            raise UserError(f"input line {line}: {err}") from None
        settings["response_format"] = record["response_format"]
    return max_new, settings, stop


def _generate_settings(record: dict, line: int) -> dict:
    """The line's CFG, watermarking and token-healing settings, checked by GenerationConfig."""
    settings = {}
    if "guidance_scale" in record:
        settings["guidance_scale"] = float(_number(record["guidance_scale"], "guidance_scale", line))
    if "token_healing" in record:
        if not isinstance(record["token_healing"], bool):
            raise UserError(f"input line {line}: 'token_healing' must be true or false")
        settings["token_healing"] = record["token_healing"]
    if "watermarking_config" in record:
        if not isinstance(record["watermarking_config"], dict):
            raise UserError(f"input line {line}: 'watermarking_config' must be an object")
        settings["watermarking_config"] = record["watermarking_config"]
    check_settings(settings, where=f"input line {line}: ")
    negative = record.get("negative_prompt_ids")
    if negative is not None:
        if (not isinstance(negative, list) or not negative
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in negative)):
            raise UserError(f"input line {line}: 'negative_prompt_ids' must be a non-empty list of token ids")
        if settings.get("guidance_scale", 1.0) == 1.0:
            raise UserError(f"input line {line}: 'negative_prompt_ids' needs a 'guidance_scale' other than 1")
        settings["negative_prompt_ids"] = negative
    return settings


def read_requests(text: str, default_max: int, skip_bad: bool = False,
                  bad: list | None = None) -> list[BatchRequest]:
    """Every input line as a request (not yet encoded); a UserError naming the line number for a
    bad one, or with ``skip_bad`` the line left out and ``(line, why)`` added to ``bad``. Runs
    before the model loads, so a bad file fails at once."""
    requests, seen = [], {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            requests.append(_read_line(number, raw, seen, default_max))
        except UserError as err:
            if not skip_bad:
                raise
            if bad is not None:
                bad.append((number, str(err)))
    if not requests:
        raise UserError("the input file holds no requests" + (" that could be read" if bad else ""))
    return requests


def _read_line(number: int, raw: str, seen: dict, default_max: int) -> BatchRequest:
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as err:
        raise UserError(f"input line {number} is not valid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(record, dict):
        raise UserError(f"input line {number} must be a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - _FIELDS)
    if unknown:
        raise UserError(f"input line {number}: unknown field(s) {', '.join(unknown)}; the fields are "
                        f"{', '.join(sorted(_FIELDS))}")
    request_id = record.get("id", f"line-{number}")
    if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
        raise UserError(f"input line {number}: 'id' must be a string or an integer")
    request_id = str(request_id)
    if request_id in seen:
        raise UserError(f"input line {number}: id {request_id!r} is also on line {seen[request_id]}")
    if ("prompt" in record) == ("messages" in record):
        raise UserError(f"input line {number} needs exactly one of 'prompt' (text) or 'messages' (a chat)")
    if "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise UserError(f"input line {number}: 'prompt' must be non-empty text")
    else:
        prompt = record["messages"]
        if (not isinstance(prompt, list) or not prompt
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                           and isinstance(m.get("content"), str) for m in prompt)):
            raise UserError(f"input line {number}: 'messages' must be a list of {{\"role\", \"content\"}} "
                            f"objects")
    max_new, settings, stop = _settings(record, number, default_max)
    seen[request_id] = number
    return BatchRequest(request_id, number, prompt, max_new, settings, stop)


def read_done_ids(path: str) -> set[str]:
    """Ids already in OUTPUT. A last line cut short (the run was killed while writing it) is
    dropped from the file, so the rerun appends after whole lines only."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
    done = set()
    for number, raw in enumerate(whole.decode("utf-8", errors="replace").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            raise UserError(f"output line {number} of {path} is not valid JSON; fix or remove it to resume") from None
        if isinstance(record, dict) and "id" in record:
            done.add(str(record["id"]))
    return done


class ResultWriter:
    """Appends each result to OUTPUT as one whole line, flushed and fsync'd before the next (a
    killed run leaves whole lines and at most one cut-short last line, which the rerun drops).
    With ``order`` (request ids in input order) a result waits until those before it are written
    or known to have failed."""

    def __init__(self, file, order: list[str] | None = None):
        self.file = file
        self.order = order
        self.next = 0
        self.held: dict[str, bytes] = {}
        self.failed: set[str] = set()

    def add(self, request_id: str, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        if self.order is None:
            self._write(line)
        else:
            self.held[request_id] = line
            self._release()

    def fail(self, request_id: str) -> None:
        self.failed.add(request_id)
        if self.order is not None:
            self._release()

    def _release(self) -> None:
        while self.next < len(self.order):
            request_id = self.order[self.next]
            if request_id in self.held:
                self._write(self.held.pop(request_id))
            elif request_id not in self.failed:
                return
            self.next += 1

    def _write(self, line: bytes) -> None:
        self.file.write(line)  # one write of a whole line to a file opened for appending
        self.file.flush()
        os.fsync(self.file.fileno())


def main(args, status: Status) -> int:
    from tqdm.auto import tqdm

    from genfn.batching import WorkloadHints, continuous_batching_context_manager
    from genfn.config import ContinuousBatchingConfig

    bad: list[tuple[int, str]] = []
    # Under --tp, rank 0 reads the files and every rank gets what it read (the same requests, the
    # same mistakes); rank 0 alone writes OUTPUT.
    shard = tensor_shard(args)
    leader = shard is None or shard.rank == 0
    text = on_rank0(shard, lambda: read_text_file(args.input, "input file"))
    requests = read_requests(text, args.max_new_tokens, args.skip_bad, bad)
    done = on_rank0(shard, lambda: _done_ids(args.output))
    todo = [r for r in requests if r.request_id not in done]
    if len(todo) < len(requests):
        status.line(f"resuming: {len(requests) - len(todo)} of {len(requests)} requests are already in {args.output}")
    if not todo:
        status.line("nothing to do")
        return _report_bad(status, bad)
    model = load_model(args, status)
    tokenizer = require_tokenizer(model)
    usable = []
    for r in todo:
        try:
            r.encode(tokenizer)
            usable.append(r)
        except UserError as err:
            if not args.skip_bad:
                raise
            bad.append((r.line, str(err)))
    todo = usable
    if not todo:
        return _report_bad(status, bad)
    lengths = [len(r.ids) for r in todo]
    longest_new = max(r.max_new_tokens for r in todo)
    rows = sum(r.settings.get("num_beams", 1) for r in todo)  # a beam request's beams decode in one forward
    most_beams = max(r.settings.get("num_beams", 1) for r in todo)
    hints = WorkloadHints(expected_prompt_len=max(1, sum(lengths) // len(lengths)), expected_new_tokens=longest_new,
                          concurrent_requests=min(rows, max(args.max_requests or 32, most_beams)),
                          max_prompt_len=max(lengths),
                          max_new_tokens=longest_new)
    config = ContinuousBatchingConfig(max_requests_per_batch=args.max_requests)
    if not leader:  # rank 0's manager schedules; this rank's runs its commands on its slice until rank 0 stops
        with continuous_batching_context_manager(model, continuous_batching_config=config, workload_hints=hints,
                                                 block=True):
            pass
        return 0
    eos = eos_ids(model)
    by_id = {r.request_id: r for r in todo}
    failed, written, start = [], [], time.perf_counter()
    with watch_compiles(status), \
            continuous_batching_context_manager(model, continuous_batching_config=config, workload_hints=hints,
                                                block=True) as manager, \
            open(args.output, "ab") as out, \
            tqdm(total=len(todo), desc="requests", unit="req", file=sys.stderr, disable=status.quiet,
                 mininterval=0.5 if status.live else 5.0, dynamic_ncols=True) as bar:
        writer = ResultWriter(out, [r.request_id for r in todo] if args.ordered else None)
        pending = set()
        for r in todo:
            try:
                manager.add_request(r.ids, request_id=r.request_id, max_new_tokens=r.max_new_tokens, **r.settings)
                pending.add(r.request_id)
            except (ValueError, TypeError) as err:
                if not args.skip_bad:
                    raise UserError(f"input line {r.line}: {err}") from None
                bad.append((r.line, f"input line {r.line}: {err}"))
                writer.fail(r.request_id)
                bar.update(1)
        try:
            _collect(manager, pending, by_id, tokenizer, eos, writer, bar, failed, written)
        except KeyboardInterrupt:
            manager.stop(block=True, timeout=30, hard_stop=True)  # not "after the requests in flight"
            status.line(f"interrupted: {len(written)} results written to {args.output}; run the same command "
                        f"again to resume", always=True)
            raise
        failed += [(by_id[rid], "the batching loop stopped") for rid in pending]
    tokens = sum(written)
    seconds = time.perf_counter() - start
    status.line(f"{len(written)} requests, {tokens} tokens in {seconds:.1f} s, "
                f"{tokens / seconds if seconds > 0 else 0:.1f} tok/s; results in {args.output}")
    for r, error in failed:
        status.line(f"error: input line {r.line} (id {r.request_id!r}) failed: {error}; rerun to retry it",
                    always=True)
    return max(1 if failed else 0, _report_bad(status, bad))


def _done_ids(output: str) -> set[str]:
    if os.path.isdir(output):
        raise UserError(f"output is a directory: {output}")
    return read_done_ids(output)


def _report_bad(status: Status, bad: list[tuple[int, str]]) -> int:
    """List the lines ``--skip-bad`` skipped; exit status 1 if there were any."""
    for _, why in sorted(bad):
        status.line(f"skipped: {why}", always=True)
    if bad:
        status.line(f"{len(bad)} bad input line{'s' if len(bad) != 1 else ''} skipped: fix them and rerun to run them",
                    always=True)
    return 1 if bad else 0


def _collect(manager, pending: set, by_id: dict, tokenizer, eos, writer: ResultWriter, bar, failed: list,
             written: list) -> None:
    """Write each request's result as it finishes (failures go to ``failed``, not to the file, so a
    rerun retries them); ``written`` gets each written result's token count."""
    while pending:
        result = manager.get_result(timeout=_RESULT_WAIT_S)
        if result is None:
            if not manager.is_running():
                return
            continue
        if not result.is_finished() or result.request_id not in pending:
            continue
        pending.discard(result.request_id)
        bar.update(1)
        r = by_id[result.request_id]
        if result.error is not None or result.status.name != "FINISHED":
            failed.append((r, result.error or result.status.name.lower()))
            writer.fail(r.request_id)
            continue
        new = list(result.generated_tokens)
        text = tokenizer.decode(new, skip_special_tokens=True)
        line = {"id": r.request_id, "text": text, "tokens": new,
                "finish_reason": finish_reason(new, text, r.max_new_tokens, eos, r.stop)}
        if result.sequence_score is not None:  # beam search
            line["sequence_score"] = result.sequence_score
        writer.add(r.request_id, line)
        written.append(len(new))
