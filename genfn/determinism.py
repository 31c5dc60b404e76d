"""A determinism report: do a request's tokens and logprobs depend on how it was run?

``check(model, prompts)`` runs the same requests alone (one ``generate`` call per prompt, the
reference), in left-padded ``generate`` batches of a few sizes and in a shuffled order, in
continuous batches with and without chunked prefill and with prefix caching, alone under 1 and 2
torch threads, and (``compiled=True``) alone with the compiled step, optionally all of it in the
batch-invariant mode (``batch_invariant=True``, ``genfn.deterministic``); it returns a ``DeterminismReport`` comparing
every variant against the reference: the share of identical requests, each divergent request's
first divergent token, and the largest difference of the chosen tokens' logprobs and logits.

Sampling noise never differs between the variants: request ``i`` samples with the key
``genfn.random.key(seed + i)`` in every one of them, so a divergence comes from the logits alone
(a reduction whose order depends on the batch's shape, the thread count or the compiler).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random as pyrandom
import time
from collections.abc import Callable, Sequence

import torch

from genfn import random as grandom
from genfn.config.checks import int_check
from genfn.kernels.invariant import batch_invariant as mode_on, deterministic
from genfn.strategies.token_choice import chosen_logprobs

__all__ = ["check", "DeterminismReport", "Comparison", "Divergence", "RequestRun", "compare", "run_generate"]

_RESULT_WAIT_S = 600.0  # the longest the report waits for one continuous-batching result


@dataclasses.dataclass(frozen=True)
class RequestRun:
    """One request's outcome in one variant: its new tokens (up to and including EOS) and, per
    token, the log-probability under the raw logits (``log_softmax``, before any processor) and
    the raw logit of the chosen token (``None`` where the variant does not expose logits)."""

    tokens: list[int]
    logprobs: list[float]
    logits: list[float] | None = None


@dataclasses.dataclass(frozen=True)
class Divergence:
    request: int  # the request's index in the prompts
    first_token: int  # the index of its first new token that differs from the reference


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One variant against the reference. The largest differences are over the tokens both runs
    chose alike before any divergence (the same token in the same context)."""

    reference: str
    variant: str
    identical: int
    total: int
    divergences: list[Divergence]
    max_logprob_diff: float
    max_logit_diff: float | None

    @property
    def identical_share(self) -> float:
        return self.identical / self.total if self.total else 1.0


@dataclasses.dataclass(frozen=True)
class DeterminismReport:
    settings: dict
    runs: dict[str, list[RequestRun]]
    comparisons: list[Comparison]
    seconds: dict[str, float]
    reused_tokens: int | None = None  # prompt tokens the prefix-cache variant took from the cache

    def comparison(self, variant: str) -> Comparison:
        for comp in self.comparisons:
            if comp.variant == variant:
                return comp
        raise KeyError(f"no variant {variant!r}; the report has {[c.variant for c in self.comparisons]}")

    def to_dict(self) -> dict:
        # Each variant's new tokens in all: identical runs of no tokens would prove nothing.
        generated = {name: sum(len(run.tokens) for run in runs) for name, runs in self.runs.items()}
        return {"settings": self.settings, "seconds": self.seconds, "reused_tokens": self.reused_tokens,
                "generated_tokens": generated, "comparisons": [dict(dataclasses.asdict(c), identical_share=c.identical_share)
                                for c in self.comparisons]}

    def format(self) -> str:
        head = ("variant", "identical", "first divergent tokens", "max |dlogprob|", "max |dlogit|")
        rows = []
        for c in self.comparisons:
            firsts = sorted(d.first_token for d in c.divergences)
            shown = ", ".join(map(str, firsts[:8])) + (", ..." if len(firsts) > 8 else "") or "-"
            rows.append((c.variant, f"{c.identical}/{c.total} ({100 * c.identical_share:.0f} %)", shown,
                         f"{c.max_logprob_diff:.3g}", "-" if c.max_logit_diff is None else f"{c.max_logit_diff:.3g}"))
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        line = lambda r: "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()  # noqa: E731
        settings = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        reference = self.comparisons[0].reference if self.comparisons else "alone"
        reused = [] if self.reused_tokens is None else [f"prefix cache: {self.reused_tokens} prompt tokens reused"]
        return "\n".join([f"determinism report ({settings}); reference: {reference}", line(head),
                          line(tuple("-" * w for w in widths)), *map(line, rows), *reused])

    __str__ = format


def compare(reference: list[RequestRun], variant: list[RequestRun], reference_name: str = "reference",
            variant_name: str = "variant") -> Comparison:
    """``variant`` against ``reference``, request by request (both in the prompts' order)."""
    if len(reference) != len(variant):
        raise ValueError(f"the runs hold {len(reference)} and {len(variant)} requests")
    identical, divergences, max_lp, max_logit = 0, [], 0.0, None
    for index, (ref, var) in enumerate(zip(reference, variant)):
        same = 0
        while same < min(len(ref.tokens), len(var.tokens)) and ref.tokens[same] == var.tokens[same]:
            same += 1
        if same == len(ref.tokens) == len(var.tokens):
            identical += 1
        else:
            divergences.append(Divergence(index, same))
        # Only where both chose the same token (after it the contexts differ; at it, the tokens).
        for a, b in zip(ref.logprobs[:same], var.logprobs[:same]):
            max_lp = max(max_lp, abs(a - b))
        if ref.logits is not None and var.logits is not None:
            for a, b in zip(ref.logits[:same], var.logits[:same]):
                max_logit = max(max_logit or 0.0, abs(a - b))
            max_logit = 0.0 if max_logit is None else max_logit
    return Comparison(reference_name, variant_name, identical, len(reference), divergences, max_lp, max_logit)


# ----------------------------------------------------------------------------------------------
# Running the variants
# ----------------------------------------------------------------------------------------------


def _request_key(seed: int) -> torch.Tensor:
    """The key row a request of seed ``seed`` samples with, alone or as any row of a batch (what
    ``generate(key=seed)`` gives a batch of one, and what the batching manager's ``seed=`` gives)."""
    return grandom.as_row_keys(grandom.key(seed), 1)[0]


def _until_eos(tokens: list[int], eos: set[int]) -> int:
    for i, token in enumerate(tokens):
        if token in eos:
            return i + 1
    return len(tokens)


def _eos_ids(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    return set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])


def _pad_id(model) -> int:
    config = model.generation_config  # None for a model built from bare parameters
    for value in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        if value is not None:
            return value[0] if isinstance(value, (list, tuple)) else value
    return 0


def _generate_rows(model, prompts: list[list[int]], seeds: list[int], settings: dict) -> list[RequestRun]:
    """One left-padded ``generate`` call over ``prompts``; a ``RequestRun`` per row."""
    from genfn.generation import generate

    width = max(len(p) for p in prompts)
    pad = _pad_id(model)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    keys = torch.stack([_request_key(s) for s in seeds]) if settings.get("do_sample") else None
    out = generate(model, input_ids, attention_mask=mask, key=keys, return_dict_in_generate=True,
                   output_logits=True, **settings)
    steps = torch.stack([step.float() for step in out.logits], dim=1)  # [B, steps, V]
    chosen = out.sequences[:, width:width + steps.shape[1]]
    # The function continuous batching reports its logprobs with: the same logits give the same bits.
    logprobs = chosen_logprobs(steps.reshape(-1, steps.shape[-1]).contiguous(), chosen.reshape(-1)).view(chosen.shape)
    logits = steps.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    eos = _eos_ids(model)
    runs = []
    for row in range(len(prompts)):
        tokens = chosen[row].tolist()
        end = _until_eos(tokens, eos)
        runs.append(RequestRun(tokens[:end], logprobs[row, :end].tolist(), logits[row, :end].tolist()))
    return runs


def run_generate(model, prompts: list[list[int]], seeds: list[int], settings: dict, size: int = 1,
                 order: list[int] | None = None) -> list[RequestRun]:
    """``prompts`` through ``generate`` in left-padded batches of ``size``, taken in ``order``
    (default: as given); a ``RequestRun`` per prompt, in the prompts' order. A building block for
    ``check``'s ``variants``."""
    order = list(range(len(prompts))) if order is None else order
    runs: list[RequestRun | None] = [None] * len(prompts)
    for start in range(0, len(order), size):
        part = order[start:start + size]
        for index, run in zip(part, _generate_rows(model, [prompts[i] for i in part], [seeds[i] for i in part],
                                                   settings)):
            runs[index] = run
    return runs


def _continuous(model, prompts, seeds, settings, order: list[int], chunked_prefill: bool,
                max_batch_tokens: int, max_requests: int, prefix_cache: bool = False,
                counts: dict | None = None) -> list[RequestRun]:
    """The requests through one continuous-batching manager of ``max_requests`` rows, added in
    ``order``. ``prefix_cache``: with block sharing on small pages, every request run twice and
    its second run kept, so that its prompt's full pages come from the prefix cache (the first
    run's blocks); the prompt tokens the cache served are added to ``counts["reused_tokens"]``."""
    from genfn.batching.manager import ContinuousBatchingManager
    from genfn.config.batching import ContinuousBatchingConfig

    longest = max(len(p) for p in prompts) + settings["max_new_tokens"]
    page = 4 if prefix_cache else 16
    rounds = 2 if prefix_cache else 1
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=rounds * len(prompts) * (longest // page + 2),
                                  max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_requests,
                                  max_blocks_per_request=longest // page + 2, allow_block_sharing=prefix_cache)
    manager = ContinuousBatchingManager(model, None, cb, chunked_prefill=chunked_prefill)
    manager.start()
    try:
        for round_ in range(rounds):
            results = _continuous_round(manager, prompts, seeds, settings, order, round_ * len(prompts))
    finally:
        manager.stop(timeout=_RESULT_WAIT_S)
    if prefix_cache:
        if not manager.stats["reused_tokens"]:
            raise RuntimeError("the prefix-cache variant reused no prompt token: its prompts are shorter than a page")
        if counts is not None:
            counts["reused_tokens"] = counts.get("reused_tokens", 0) + manager.stats["reused_tokens"]
    return [RequestRun(list(results[i].generated_tokens), [float(x) for x in results[i].logprobs])
            for i in range(len(prompts))]


def _continuous_round(manager, prompts, seeds, settings, order: list[int], first_id: int) -> dict:
    from genfn.batching.requests import RequestStatus

    per_request = {k: v for k, v in settings.items() if k != "max_new_tokens"}
    for i in order:
        extra = {"seed": seeds[i]} if settings.get("do_sample") else {}
        manager.add_request(prompts[i], request_id=first_id + i, max_new_tokens=settings["max_new_tokens"],
                            **per_request, **extra)
    results = {}
    while len(results) < len(order):
        # A long run (64 requests x 256 tokens on a loaded machine) may take far longer than this
        # in all; what signals a stuck manager is a long wait for the next result.
        out = manager.get_result(timeout=_RESULT_WAIT_S)
        if out is None:
            raise TimeoutError(f"continuous batching returned {len(results)} of {len(order)} requests, "
                               f"then none for {_RESULT_WAIT_S:.0f} s")
        if out.status != RequestStatus.FINISHED:
            raise RuntimeError(f"request {out.request_id} ended {out.status}: {out.error}")
        results[out.request_id - first_id] = out
    return results


@contextlib.contextmanager
def _threads(count: int | None):
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _as_token_lists(model, prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise TypeError("prompts must be a non-empty list of strings or of token-id lists")
    if all(isinstance(p, str) for p in prompts):
        tokenizer = getattr(model, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("text prompts need a model with a tokenizer; pass token-id lists instead")
        ids = [torch.as_tensor(tokenizer(p)["input_ids"]).reshape(-1).tolist() for p in prompts]
    elif all(isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p) for p in prompts):
        ids = [list(p) for p in prompts]
    else:
        raise TypeError("prompts must be all strings or all lists of token ids")
    if any(not p for p in ids):
        raise ValueError("every prompt needs at least one token")
    return ids


def _positive_ints(name: str, values) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of positive ints, got {type(values).__name__}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{name} must hold positive ints, got {list(values)!r}")
    return sorted(set(values))


def check(model, prompts, *, max_new_tokens: int = 32, do_sample: bool = False, seed: int = 0,
          batch_sizes: Sequence[int] = (4, 16), continuous: bool = True, continuous_sizes: Sequence[int] | None = None,
          chunk_tokens: int = 16, threads: Sequence[int] = (1, 2), compiled: bool = False,
          side_batch_size: int = 1, prefix_cache: bool = True, batch_invariant: bool = False,
          variants: dict[str, Callable[[list[list[int]], list[int], dict], list[RequestRun]]] | None = None,
          progress: Callable[[str, float, Comparison | None], None] | None = None,
          **generation_settings) -> DeterminismReport:
    """Run ``prompts`` (strings, or lists of token ids) in every variant and compare each against
    running them alone.

    ``batch_sizes``: left-padded ``generate`` batches of these sizes (the largest also in a
    shuffled order); ``continuous``: continuous batching, the prompts added in a shuffled order,
    with chunked prefill (``chunk_tokens`` of prompt per forward beside the decoding rows) and
    without it; ``continuous_sizes``: one such pair of managers per size, each running at most
    that many requests per forward (``None``: one pair with room for every request);
    ``prefix_cache``: continuous batching (the largest size) with prefix caching, each request's
    prompt pages taken from the cache of its own earlier run (the report's ``reused_tokens``
    counts the prompt tokens the cache served); ``threads``: alone under each of these torch
    thread counts (the caller's count is restored); ``compiled``: alone with the compiled decode
    step (slow to build). ``side_batch_size``: run the thread and compiled variants in
    ``generate`` batches of this size instead of alone (1), which makes a long check affordable:
    they are still compared against the eager requests alone. ``batch_invariant``: every variant
    in the batch-invariant mode (``genfn.deterministic``; a check called inside it runs in it too,
    and the report's settings say which). ``variants``: more variants, ``name -> fn(prompts,
    seeds, settings) -> [RequestRun]``. ``progress``: called as each variant ends with its name, its
    seconds and its comparison with the reference (``None`` for the reference itself), so that a
    long check (hours on a loaded machine) shows its results as they come. ``generation_settings``: more ``generate`` settings
    (``temperature``, ``top_k``, ...), the same for every request. Request ``i`` samples with the
    key of ``seed + i`` in every variant.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    batch_sizes, threads = _positive_ints("batch_sizes", batch_sizes), _positive_ints("threads", threads)
    if continuous_sizes is not None:
        continuous_sizes = _positive_ints("continuous_sizes", continuous_sizes)
        if not continuous_sizes:
            raise ValueError("continuous_sizes must hold at least one size (None: room for every request)")
    for name, flag in (("continuous", continuous), ("prefix_cache", prefix_cache),
                       ("batch_invariant", batch_invariant), ("compiled", compiled)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    for name, value in (("chunk_tokens", chunk_tokens), ("side_batch_size", side_batch_size)):
        int_check(minimum=1)(name, value)
    ids = _as_token_lists(model, prompts)
    seeds = [seed + i for i in range(len(ids))]
    settings = dict(generation_settings, max_new_tokens=max_new_tokens, do_sample=do_sample)
    in_order = list(range(len(ids)))
    shuffled = in_order[:]
    pyrandom.Random(seed).shuffle(shuffled)
    longest = max(len(p) for p in ids)
    counts: dict[str, int] = {}

    plan: dict[str, Callable[[], list[RequestRun]]] = {
        "alone": lambda: run_generate(model, ids, seeds, settings, 1, in_order)}
    for size in batch_sizes:
        if size > 1:
            plan[f"generate batch {size}"] = (
                lambda size=size: run_generate(model, ids, seeds, settings, size, in_order))
    if batch_sizes and max(batch_sizes) > 1:
        size = max(batch_sizes)
        plan[f"generate batch {size}, shuffled"] = lambda: run_generate(model, ids, seeds, settings, size,
                                                                             shuffled)
    if continuous:
        named = continuous_sizes is not None
        for rows in continuous_sizes or [len(ids)]:
            label = f"continuous {rows}" if named else "continuous"
            # Chunked: the decoding rows plus chunk_tokens of prompt per forward, so a full batch
            # still decodes every row in one forward while the prompts are cut.
            plan[f"{label}, chunked prefill"] = lambda rows=rows: _continuous(
                model, ids, seeds, settings, shuffled, True, min(rows, len(ids)) + chunk_tokens, rows)
            plan[f"{label}, whole prompts"] = lambda rows=rows: _continuous(
                model, ids, seeds, settings, shuffled, False, max(longest * min(rows, len(ids)), 64), rows)
        if prefix_cache and longest >= 5:  # at least one full page of 4 to share
            rows = max(continuous_sizes or [len(ids)])
            label = f"continuous {rows}" if named else "continuous"
            plan[f"{label}, prefix cache"] = lambda: _continuous(
                model, ids, seeds, settings, shuffled, True, min(rows, len(ids)) + chunk_tokens, rows,
                prefix_cache=True, counts=counts)
    side = "alone" if side_batch_size == 1 else f"generate batch {side_batch_size}"
    for count in threads:
        def with_threads(count=count):
            with _threads(count):
                return run_generate(model, ids, seeds, settings, side_batch_size, in_order)
        plan[f"{side}, {count} thread{'s' if count > 1 else ''}"] = with_threads
    if compiled:
        static = dict(settings, cache_implementation="static", max_cache_len=longest + max_new_tokens)
        plan[f"{side}, compiled"] = lambda: run_generate(model, ids, seeds, static, side_batch_size, in_order)
    for name, fn in (variants or {}).items():
        if name in plan:
            raise ValueError(f"variant name {name!r} is taken; the built-in ones are {list(plan)}")
        plan[name] = lambda fn=fn: fn(ids, seeds, dict(settings))

    runs, seconds = {}, {}
    # Unset, the caller's mode holds (a check inside genfn.deterministic() runs in it).
    with deterministic() if batch_invariant else contextlib.nullcontext():
        for name, run in plan.items():
            start = time.perf_counter()
            runs[name] = run()
            seconds[name] = round(time.perf_counter() - start, 3)
            if progress is not None:
                against = None if name == "alone" else compare(runs["alone"], runs[name], "alone", name)
                progress(name, seconds[name], against)
        mode = mode_on()
    comparisons = [compare(runs["alone"], runs[name], "alone", name) for name in plan if name != "alone"]
    report_settings = dict(prompts=len(ids), max_new_tokens=max_new_tokens, do_sample=do_sample, seed=seed,
                           dtype=str(getattr(model, "dtype", "?")).replace("torch.", ""),
                           threads=torch.get_num_threads(), batch_invariant=mode, **generation_settings)
    return DeterminismReport(report_settings, runs, comparisons, seconds, counts.get("reused_tokens"))
