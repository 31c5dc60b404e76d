"""One decode step's native layer stack, this tree's decode library against a git revision's, in one process.

    python benchmarks/stack_ab.py --model llama-1b-q4_0.gguf --baseline main
    python benchmarks/stack_ab.py --model SmolLM2-135M-Instruct.llama.cpp-Q4_K_M.gguf --baseline HEAD~1 --rows 8
    python benchmarks/stack_ab.py --model SmolLM2-135M-Instruct.Q4_1.gguf --baseline HEAD~1 --rows 4 --prompt copy
    python benchmarks/stack_ab.py --model llama-1b-bf16.gguf --quantize coded_bf16 --baseline HEAD~1

The step's own call is captured from an eager ``genfn.generate`` of the file (greedy on a repeated
sentence, or with ``--prompt copy`` on the copy task's longer prompt; ``--rows`` above 1 drafts that
many minus one tokens by prompt lookup, so the call verifies ``--rows`` positions of one sequence;
``--quantize coded_bf16`` loads a BF16/F16 file in bfloat16 with its linears coded), then replayed:
each round times ``--calls`` calls of this tree's
``decode_stack`` and as many of the revision's (``genfn.bench.revision_kernels``, op namespace
``genfn_kernels_base``; the order swapped every other round), and a ``tensor.sum`` over 256 MB
beside them, because this VM's memory reads ~55 or ~90 GB/s by the minute and a one-row stack follows
it, and the time the two threads take to meet (``thread_meeting_ns``), which says whether they sat on
one die or on two that minute (the memory's fast state is the second). Both libraries must give the
same bits. Prints each round's medians, the memory's rate, the meeting and the ratio, then the median
ratio over the rounds in each state.

The revision's library takes this tree's table (the layout must not have changed between them) and
reaches the K-quant kernels through this tree's K-quant library: for a change inside the K-quant
library, alternate fresh processes instead (``trees_ab.py``). A revision whose ``kquant.h`` entry key
differs from this tree's (before d3df57f, where ``linear_share`` took no barrier) refuses the table of
a file with K-quant layers: for those, too, alternate fresh processes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import genfn
from genfn.bench.decode import thread_meeting_ns
from genfn.bench.revision_kernels import build_at_revision
from genfn.kernels import decode_layer, native

# A meeting of the two threads (thread_meeting_ns) slower than this, in ns, puts a round in the state
# where they sit on two dies (on sessions 23-35's Zen 5 VM ~30-60 ns on one, ~170-300 on two).
_TWO_DIES_NS = 100.0


def capture(path: str, rows: int, prompt: str = "short", quantize: str = "gguf") -> tuple:
    """The arguments of the median-time ``run_stack`` call of ``rows`` rows in an eager generate of
    ``prompt``: ``"short"`` (a sentence four times, ~50 slots attended) or ``"copy"`` (the rewriting
    task of ``assisted.py`` and ``lookup_rounds.py``, ~300 slots: the attention weighs more there).
    ``quantize``: ``"gguf"`` (blocks as stored) or ``"coded_bf16"`` (bfloat16, linears coded)."""
    dtype = torch.bfloat16 if quantize == "coded_bf16" else torch.float32
    model = genfn.load(path, dtype=dtype, quantize=quantize)
    calls = []
    original = decode_layer.run_stack

    def spy(*args):
        out = original(*args)
        if args[0].reshape(-1, args[0].shape[-1]).shape[0] == rows:  # the table stays shared
            calls.append(tuple(a.clone() if isinstance(a, torch.Tensor) and a is not args[1] else a for a in args))
        return out

    if prompt == "copy":
        from assisted import prompts

        ids, mask = prompts(model.tokenizer, 1)
    else:
        ids = torch.tensor([model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)])
        mask = None
    extra = {"prompt_lookup_num_tokens": rows - 1, "num_assistant_tokens_schedule": "constant"} if rows > 1 else {}
    decode_layer.run_stack = spy
    # A bfloat16 step takes the native stack only inside a compiled step (decode_layer.stack_takes): the
    # eager generate that records the call says it is one.
    compiling = decode_layer.torch.compiler.is_compiling
    if quantize == "coded_bf16":
        decode_layer.torch.compiler.is_compiling = lambda: True
    try:
        genfn.generate(model, ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                       cache_implementation="static", disable_compile=True, **extra)
    finally:
        decode_layer.run_stack = original
        decode_layer.torch.compiler.is_compiling = compiling
    if not calls:
        raise SystemExit(f"no step of {rows} rows ran through the native stack for {path}")
    return model, calls[len(calls) // 2]


def stack_call(namespace, args: tuple) -> torch.Tensor:
    x, table, layers, cos, sin, keys, values, slots, mask, eps = args
    return namespace.decode_stack(x.reshape(-1, x.shape[-1]), table, layers, cos.reshape(-1, cos.shape[-1]),
                                  sin.reshape(-1, sin.shape[-1]), keys, values, slots,
                                  mask.reshape(-1, mask.shape[-1]), eps, cos.shape[-1] ** -0.5)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--baseline", required=True, help="git revision whose decode kernels to compare with")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--prompt", choices=["short", "copy"], default="short",
                    help="what the captured step attends: a short sentence or the copy task's ~300 slots")
    ap.add_argument("--quantize", choices=["gguf", "coded_bf16"], default="gguf")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.ops.load_library(str(build_at_revision(native.DECODE, args.baseline,
                                                 {"genfn_kernels": "genfn_kernels_base"})))
    model, call = capture(args.model, args.rows, args.prompt, args.quantize)  # kept alive: the call's table points into its weights
    libraries = {"this tree": torch.ops.genfn_kernels, args.baseline: torch.ops.genfn_kernels_base}
    # Both write the same cache slots with the same keys and values: replaying either leaves the call's inputs.
    outputs = [stack_call(namespace, call) for namespace in libraries.values()]
    if not torch.equal(*outputs):
        raise SystemExit("the two libraries give different bits")
    buffer = torch.ones(64 * 1024 * 1024)
    ratios: dict[str, list[float]] = {"one die": [], "two dies": []}
    print(f"{args.model}, {args.rows} row(s), {args.prompt} prompt, {args.threads} threads; "
          f"ms per stack call (median of {args.calls})")
    for round_ in range(args.rounds):
        order = list(libraries.items())[:: 1 if round_ % 2 == 0 else -1]
        medians = {}
        for name, namespace in order:
            for _ in range(3):
                stack_call(namespace, call)
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                stack_call(namespace, call)
                times.append(time.perf_counter() - start)
            medians[name] = statistics.median(times) * 1e3
        start = time.perf_counter()
        buffer.sum()
        gbs = buffer.numel() * 4 / (time.perf_counter() - start) / 1e9
        meeting = thread_meeting_ns()
        ratio = medians["this tree"] / medians[args.baseline]
        ratios["two dies" if meeting > _TWO_DIES_NS else "one die"].append(ratio)
        print(f"  round {round_ + 1}: " + ", ".join(f"{n} {m:.3f}" for n, m in medians.items())
              + f"; tensor.sum {gbs:.1f} GB/s, a meeting {meeting:.0f} ns; this tree / {args.baseline} {ratio:.3f}")
    for state, values in ratios.items():
        if values:
            print(f"threads on {state} ({len(values)} rounds): median ratio {statistics.median(values):.3f} "
                  f"(range {min(values):.3f}-{max(values):.3f})")


if __name__ == "__main__":
    main()
