"""Structured outputs: the grammar engines on SmolLM2's tokenizer, and what a constraint costs a decode.

    python benchmarks/structured.py                 # engines + decode at batch 1 and 16
    python benchmarks/structured.py --skip-decode   # engines only (no model load)
    OMP_WAIT_POLICY=PASSIVE python benchmarks/structured.py --skip-engines   # on a busy machine

1. Engines (llguidance, xgrammar when installed), per JSON schema of ``genfn/bench/structured_schemas.py``:
   the first compile (the engine's tokenizer tables are built once before, and reported apart),
   the cached compile (``genfn.structured.compile`` per (tokenizer, spec)), and the mask fill and
   token accept per token along one valid answer (the same token sequence for both engines: a
   seeded walk through llguidance's masks).
2. Decode: SmolLM2 greedy ``generate`` with ``response_format`` against the same prompts without it,
   batch 1 and 16, eager and compiled, interleaved (A/B/A/B) in one process; each unconstrained run
   decodes as many steps as its constrained twin (``min_new_tokens``). A streamer notes when each
   step's tokens arrive, so the compared figure is the median decode step (prefill left out).

Prints ratios and writes ``benchmarks/results/structured-<date>.json``. The machine this runs on
may be shared: compare ratios from one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from genfn.bench.results import write_results
from genfn import structured  # noqa: E402
from genfn.default_model import default_model_path  # noqa: E402
from genfn.processors.grammar import allowed_tokens  # noqa: E402
from genfn.tokenizer import Tokenizer  # noqa: E402
from genfn.bench.structured_schemas import SCHEMAS  # noqa: E402

VOCAB = 49152


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _walk(grammar, seed: int, limit: int = 200) -> list[int]:
    """A valid token sequence: seeded random choices among allowed tokens, ending as soon as EOS may."""
    gen = torch.Generator().manual_seed(seed)
    matcher = grammar.matcher()
    row = torch.zeros(structured.bitmask_width(VOCAB), dtype=torch.int32)
    tokens = []
    for _ in range(limit):
        if matcher.can_terminate():
            break
        matcher.fill_bitmask(row)
        allowed = allowed_tokens(row, VOCAB).nonzero().reshape(-1)
        allowed = allowed[allowed != grammar.eos_token_id]
        token = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
        assert matcher.accept(token)
        tokens.append(token)
    return tokens


def _replay_cost(grammar, tokens: list[int], repeats: int = 3) -> tuple[float, float]:
    """(us per mask fill, us per accept) along ``tokens``, best of ``repeats``."""
    row = torch.zeros(structured.bitmask_width(VOCAB), dtype=torch.int32)
    best_fill, best_accept = float("inf"), float("inf")
    for _ in range(repeats):
        matcher = grammar.matcher()
        fill = accept = 0.0
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_bitmask(row)
            middle = time.perf_counter()
            matcher.accept(token)
            fill += middle - start
            accept += time.perf_counter() - middle
        best_fill, best_accept = min(best_fill, fill / len(tokens)), min(best_accept, accept / len(tokens))
    return best_fill * 1e6, best_accept * 1e6


def bench_engines(tokenizer) -> dict:
    engines = structured.available_engines()
    sequences = {}
    results: dict = {"engines": {}}
    for engine in engines:
        start = time.perf_counter()
        structured.compile(tokenizer, {"regex": "a"}, vocab_size=VOCAB, engine=engine)
        tables_s = time.perf_counter() - start  # the engine's tokenizer tables (+ a trivial grammar)
        per_schema = []
        for i, (what, schema) in enumerate(SCHEMAS):
            start = time.perf_counter()
            grammar = structured.compile(tokenizer, _format(schema), vocab_size=VOCAB, engine=engine)
            first = time.perf_counter() - start
            start = time.perf_counter()
            structured.compile(tokenizer, _format(schema), vocab_size=VOCAB, engine=engine)
            cached = time.perf_counter() - start
            if i not in sequences:  # walked once, on the first engine, and replayed on every engine
                sequences[i] = _walk(grammar, seed=i)
            fill_us, accept_us = _replay_cost(grammar, sequences[i])
            per_schema.append({"schema": what, "compile_ms": first * 1e3, "cached_compile_us": cached * 1e6,
                               "tokens": len(sequences[i]), "fill_us": fill_us, "accept_us": accept_us})
        results["engines"][engine] = {"tokenizer_tables_s": tables_s, "schemas": per_schema}
        median = lambda key: statistics.median(r[key] for r in per_schema)  # noqa: E731
        print(f"{engine:11s} tokenizer tables {tables_s:6.2f} s | per schema (median of {len(per_schema)}): "
              f"compile {median('compile_ms'):7.2f} ms, cached {median('cached_compile_us'):5.1f} us, "
              f"mask fill {median('fill_us'):6.1f} us/token, accept {median('accept_us'):5.1f} us/token "
              f"(max compile {max(r['compile_ms'] for r in per_schema):.1f} ms, "
              f"max fill {max(r['fill_us'] for r in per_schema):.1f} us)")
    return results


def _prompts(tokenizer, batch: int):
    rows = []
    for i in range(batch):
        what, schema = SCHEMAS[i % len(SCHEMAS)]
        messages = [{"role": "user", "content": f"Give me {what}. Answer in JSON only."}]
        rows.append((tokenizer.apply_chat_template(messages, add_generation_prompt=True), _format(schema)))
    width = max(len(p) for p, _ in rows)
    pad = tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in rows])
    return ids, mask, [f for _, f in rows]


class _StepClock:
    """A streamer that notes when each step's tokens arrive: the gaps between them are decode steps
    alone (the prompt's put and the prefill before the first token are left out)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, tokens) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def step_seconds(self) -> float:
        gaps = [b - a for a, b in zip(self.times[1:], self.times[2:])]  # [0] is the prompt
        return statistics.median(gaps)


def _timed(model, ids, **settings) -> tuple[float, int]:
    """(median seconds per decode step, steps decoded) of one ``generate`` call."""
    import genfn

    clock = _StepClock()
    out = genfn.generate(model, ids, streamer=clock, **settings)
    return clock.step_seconds(), out.shape[1] - ids.shape[1]


def bench_decode(batches: list[int], repeats: int, max_new: int, modes: list[str]) -> dict:
    import genfn

    model = genfn.load(default_model_path())
    engines = structured.available_engines()
    results = {}
    for mode in modes:
        compiled = dict(cache_implementation="static", max_cache_len=512) if mode == "compiled" else {}
        for batch in batches:
            ids, mask, formats = _prompts(model.tokenizer, batch)
            settings = dict(attention_mask=mask, max_new_tokens=max_new, **compiled)
            steps = {}
            for engine in engines:  # warm-up: compiles the grammars (and the step), learns the step counts
                _, steps[engine] = _timed(model, ids, response_format=formats, grammar_engine=engine, **settings)
                n = steps[engine]
                _timed(model, ids, **{**settings, "max_new_tokens": n, "min_new_tokens": n})
            timings = {name: [] for name in [*engines, *(f"free/{e}" for e in engines)]}
            for _ in range(repeats):
                for engine in engines:  # interleaved: constrained, then the same prompts free, per engine
                    timings[engine].append(_timed(model, ids, response_format=formats, grammar_engine=engine,
                                                  **settings)[0])
                    n = steps[engine]  # the free run decodes as many steps as its constrained twin
                    timings[f"free/{engine}"].append(
                        _timed(model, ids, **{**settings, "max_new_tokens": n, "min_new_tokens": n})[0])
            for engine in engines:
                c, f = min(timings[engine]), min(timings[f"free/{engine}"])
                results.setdefault(mode, {}).setdefault(batch, {})[engine] = {
                    "constrained_ms_per_step": c * 1e3, "free_ms_per_step": f * 1e3, "ratio": c / f,
                    "steps": steps[engine]}
                print(f"decode {mode:8s} batch {batch:2d} {engine:11s}: constrained {c * 1e3:7.2f} ms/step, "
                      f"unconstrained {f * 1e3:7.2f} ms/step, ratio {c / f:.3f} ({steps[engine]} steps, median "
                      f"step of each run, best of {repeats} runs, interleaved)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-engines", action="store_true")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--modes", default="eager,compiled",
                        help="eager (dynamic cache) and/or compiled (static cache, the compiled decode step)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; engines: {structured.available_engines()}; "
          f"the machine may be shared: compare ratios within this run")
    tokenizer = Tokenizer.from_gguf(default_model_path())
    payload = {} if args.skip_engines else bench_engines(tokenizer)
    if not args.skip_decode:
        payload["decode"] = bench_decode([int(b) for b in args.batches.split(",")], args.repeats, args.max_new_tokens,
                                         args.modes.split(","))
    print("wrote", write_results("structured", payload, args.out))


if __name__ == "__main__":
    main()
