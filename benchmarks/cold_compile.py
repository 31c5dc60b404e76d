"""A cold compiled first token, before/after: SmolLM2 Q4_1's static-cache step compiled in a fresh
inductor cache, in fresh processes alternating between two genfn checkouts.

    flock /tmp/genfn-bench.lock python benchmarks/cold_compile.py --before /tmp/base --rounds 3

``--before`` is a checkout (or ``git archive`` of one) whose ``genfn`` the "before" processes
import; the "after" ones import this checkout's. Each process loads the embedded model on its Q4_1
blocks (``genfn.load(quantize="gguf")``), imports dynamo and inductor, and times
``genfn.generate(..., cache_implementation="static", max_new_tokens=2)`` in a fresh temporary
``TORCHINDUCTOR_CACHE_DIR`` (genfn's native kernels come from their usual, already built cache:
their one-time build is not part of a cold compile). It reports the first call's wall seconds, its
CPU seconds in the process and in finished children (``resource.getrusage``: g++ and the ISA
probes' ``dlopen`` checks), the load average, the two generated tokens, and every g++ run with its
start and end from process start (``--timeline``). Prints one JSON line per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The history of the Roman Empire is long and complicated. It began when"
CHILD_TIMEOUT_S = 900


def child(timeline: bool) -> dict:
    """Runs in the measured process (a fresh inductor cache is already in its environment)."""
    import resource
    import threading

    start_of_process = time.perf_counter()
    gxx = []
    popen_init = subprocess.Popen.__init__

    def recording_init(self, args, *rest, **kwargs):
        popen_init(self, args, *rest, **kwargs)
        command = args if isinstance(args, str) else " ".join(map(str, args))
        if command.split(" ", 1)[0].endswith(("g++", "c++")) and " -o " in command:
            run = {"target": command.split(" -o ", 1)[1].split()[0].rsplit("/", 1)[-1][-24:],
                   "start": round(time.perf_counter() - start_of_process, 2)}
            gxx.append(run)

            def note_end():
                while self.poll() is None:
                    time.sleep(0.02)
                run["end"] = round(time.perf_counter() - start_of_process, 2)

            threading.Thread(target=note_end, daemon=True).start()

    subprocess.Popen.__init__ = recording_init
    import torch

    import genfn

    model = genfn.load(quantize="gguf")
    ids = torch.tensor([model.tokenizer.encode(PROMPT)])
    import torch._dynamo  # noqa: F401  (imported before the clock starts: the warm start pays it too)
    import torch._inductor.compile_fx  # noqa: F401

    def cpu(who):
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    own, children, start = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    with torch.no_grad():
        out = genfn.generate(model, ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=2,
                             cache_implementation="static", max_cache_len=128)
    result = {"first_call_s": round(time.perf_counter() - start, 2),
              "cpu_own_s": round(cpu(resource.RUSAGE_SELF) - own, 2),
              "cpu_children_s": round(cpu(resource.RUSAGE_CHILDREN) - children, 2),
              "gxx_runs": len(gxx), "load": [round(x, 2) for x in os.getloadavg()],
              "tokens": out[0, -2:].tolist(), "genfn": str(Path(genfn.__file__).parents[1])}
    if timeline:
        result["gxx"] = gxx
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", help="checkout whose genfn the 'before' processes import (none: only 'after')")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeline", action="store_true", help="also list every g++ run with its start and end")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.timeline)))
        return
    roots = ([("before", Path(args.before).resolve())] if args.before else []) + [("after", ROOT)]
    for round_ in range(args.rounds):
        for name, root in roots:
            with tempfile.TemporaryDirectory(prefix="cold-compile-") as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=str(root))
                command = [sys.executable, str(Path(__file__).resolve()), "--child"] + (["--timeline"] * args.timeline)
                done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
                if done.returncode:
                    sys.exit(f"{name} process failed:\n{done.stderr[-4000:]}")
                print(json.dumps({"round": round_, "checkout": name, **json.loads(done.stdout.splitlines()[-1])}),
                      flush=True)


if __name__ == "__main__":
    main()
