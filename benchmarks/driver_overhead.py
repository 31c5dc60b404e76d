"""What the driver spends between compiled decode steps, per step.

    python benchmarks/driver_overhead.py bfloat16 1
    python benchmarks/driver_overhead.py /work/models-tmp/llama-1b-q4_k_m.gguf 1

Runs ``genfn.generate(cache_implementation="static")`` of 128 greedy tokens on SmolLM2 (once to
compile, then ``ROUNDS`` times, env, default 3; a ``.gguf`` path in place of the dtype: that file) with the driver's between-step functions wrapped in
timers: ``_observe`` (the host read of done flags and lengths, user criteria, the finiteness check,
per-step outputs; ``_HostView`` is its read), ``limit_attention`` (the attended span) and the
compiled step's call (``advance``: flattening the state, dynamo, the compiled graph, the rebuild).
Prints ms per step for each and the whole generate call per step (the prefill included).
"""

from __future__ import annotations

import collections
import os
import sys
import time


import torch  # noqa: E402

from genfn.bench.decode import batch_inputs  # noqa: E402
from step_profile import load  # noqa: E402


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or {"-h", "--help"} & set(argv):
        raise SystemExit(print(__doc__))
    dname, batch = argv[0], int(argv[1]) if len(argv) > 1 else 1
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    import genfn
    import genfn.driver as driver

    model = load(dname, dname if dname.endswith(".gguf") else None)
    ids, mask = batch_inputs(model.tokenizer, batch, pad_id=2)
    new_tokens = 128
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(name, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name] += time.perf_counter() - start
            return out

        return call

    def run():
        with torch.no_grad():
            genfn.generate(model, ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=2, cache_implementation="static", max_cache_len=256)

    run()  # compile, untimed
    compiled_step = driver.compiled_step
    driver.compiled_step = lambda *args, **kwargs: timed("advance (compiled step call)", compiled_step(*args, **kwargs))
    driver._observe = timed("_observe", driver._observe)
    driver._HostView = timed("  of which _HostView", driver._HostView)
    driver.limit_attention = timed("limit_attention", driver.limit_attention)
    steps = new_tokens - 1  # init chooses the first token
    best = float("inf")
    best_spent: dict[str, float] = {}
    for _ in range(int(os.environ.get("ROUNDS", "3"))):
        spent.clear()
        start = time.perf_counter()
        run()
        total = time.perf_counter() - start
        if total < best:
            best, best_spent = total, dict(spent)
    print(f"# {dname} batch {batch}: generate {best * 1e3 / steps:.3f} ms per step ({new_tokens} tokens, "
          f"prefill included), fastest of {os.environ.get('ROUNDS', '3')}")
    for name, seconds in best_spent.items():
        print(f"  {name:30s} {seconds * 1e3 / steps:7.3f} ms/step")


if __name__ == "__main__":
    main()
