"""The compiled step's C++ wrapper at -O1 (inductor's default) against -O0: compile time and step time.

    python benchmarks/wrapper_opt_level.py [--rounds 10]

The wrapper (~3,800 lines of shim calls for SmolLM2's step) is the longest g++ job of a cold
compile: ~8-9 CPU s at -O1, ~3.5 at -O0 (``aot_inductor.compile_wrapper_opt_level``). This loads
the embedded SmolLM2 on its Q4_1 blocks in one process with a fresh inductor cache, compiles the
static-cache step at each level (the first call of the first level also pays inductor's ISA probes;
the second reuses the kernels' C++, so its first call is the wrapper's build and the trace), then
alternates greedy decodes of 128 tokens at both levels and prints each level's ms per step (median
and every round) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

PROMPT = "The history of the Roman Empire is long and complicated. It began when"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="wrapper-opt-level-")
    import torch

    import genfn
    from genfn import compile_boundary

    model = genfn.load(quantize="gguf")
    ids = torch.tensor([model.tokenizer.encode(PROMPT)])
    defaults = dict(compile_boundary._CPU_COMPILE_OPTIONS)

    def generate(level: str, new_tokens: int):
        compile_boundary._CPU_COMPILE_OPTIONS.clear()
        compile_boundary._CPU_COMPILE_OPTIONS.update(defaults, **{"aot_inductor.compile_wrapper_opt_level": level})
        with torch.no_grad():
            return genfn.generate(model, ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=2, cache_implementation="static", max_cache_len=256)

    levels = ("O1", "O0")
    first, steps, tokens = {}, {level: [] for level in levels}, {}
    for level in levels:
        start = time.perf_counter()
        generate(level, 2)
        first[level] = round(time.perf_counter() - start, 1)
    for _ in range(args.rounds):
        for level in levels:
            start = time.perf_counter()
            generate(level, 1)
            one = time.perf_counter() - start
            start = time.perf_counter()
            tokens[level] = generate(level, 129)[0, -16:].tolist()
            steps[level].append(round((time.perf_counter() - start - one) / 128 * 1000, 3))
    compile_boundary._CPU_COMPILE_OPTIONS.clear()
    compile_boundary._CPU_COMPILE_OPTIONS.update(defaults)
    print(json.dumps({"load": os.getloadavg(), "first_call_s": first, "tokens_equal": tokens["O1"] == tokens["O0"],
                      "ms_per_step": {level: {"median": statistics.median(v), "rounds": v} for level, v in steps.items()}}))


if __name__ == "__main__":
    main()
