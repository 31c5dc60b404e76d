"""What a model's layer matrices cost to stream at batch 1: the kernels, and a plain read of the same bytes.

    python benchmarks/stream_split.py --model /work/models-tmp/llama-1b-q4_0.gguf
    python benchmarks/stream_split.py --model llama-1b-q4_k_m.gguf --rounds 20

Loads the file with ``quantize="gguf"`` and, in one process, rounds alternating, times four reads
of the layers' linears (the LM head left out):

- ``kernels``: ``genfn.kernels.linear`` of one row through every matrix, one call each, as a
  step's layers call them (each matrix split over the threads on its own);
- ``plain read, one region``: ``benchmarks/stream_read.cpp`` (compiled on first use) adds up the
  same bytes in one parallel region, each thread its share of every matrix's tensors side by side,
  the threads meeting after each matrix: the kernels' own stream with no arithmetic and no per-call
  cost. ``--threads 1`` shows what one core draws, which is what caps a one-row kernel once the
  memory is fast (*Session 26* in docs/measurements/scale-sessions.md);
- ``sum each tensor``: ``tensor.sum`` over each tensor those matrices are made of (codes, scales,
  minimums, K-quant rows), read as float32: the same streams with no arithmetic;
- ``sum one buffer``: ``tensor.sum`` over one buffer of the same bytes (what the benchmarks' read
  bandwidth reports);
- ``stack`` (``--stack``): the step's own native call of the layers (``decode_layer.run_stack``, its
  arguments taken from a short eager ``generate``, a row of one token attending ~50 slots): the
  linears with their attention, norms, the activations' quantization and the barriers between
  them. ``stack`` against ``kernels`` is what a step's layers cost besides their products.

Prints GB/s of each (best and median). ``kernels`` against ``plain read, one region`` is the
kernels' own share; ``sum each tensor`` against ``sum one buffer`` is what streaming the matrices
one by one, an op each, costs torch's reader (issue 31's 80 % bar compares a step's read with the
one buffer).
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import genfn  # noqa: E402
from genfn import kernels  # noqa: E402
from genfn.bench.timing import interleaved  # noqa: E402
from genfn.state.base import tree_flatten  # noqa: E402

LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")


def plain_reader():
    """``read_matrices(matrices, threads)`` of ``stream_read.cpp``, compiled into torch's extension cache."""
    from torch.utils.cpp_extension import load

    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_read.cpp")
    return load("genfn_stream_read", [source], extra_cflags=["-O2", "-fopenmp"], extra_ldflags=["-fopenmp"])


def stack_call(model):
    """A call of the layers' native stack with the arguments of the last step of a short eager
    ``generate`` (the cache at that step: writing the same slot again changes nothing)."""
    from genfn.kernels import decode_layer

    calls = []
    run_stack = decode_layer.run_stack

    def keep(*args, **kwargs):
        calls.append((args, kwargs))
        return run_stack(*args, **kwargs)

    decode_layer.run_stack = keep
    try:
        prompt = torch.tensor([model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)])
        with torch.no_grad():
            genfn.generate(model, prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           cache_implementation="static", max_cache_len=256, disable_compile=True)
    finally:
        decode_layer.run_stack = run_stack
    if not calls:
        raise SystemExit("--stack: this model's steps do not run the native stack")
    args, kwargs = calls[-1]

    def call():
        with torch.no_grad():
            run_stack(*args, **kwargs)

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stack", action="store_true", help="also time the step's native call of the layers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = genfn.load(args.model, quantize="gguf")
    weights = [layer[name] for layer in model.params["layers"] for name in LINEARS]
    matrices = [[t for t in tree_flatten(w)[0] if isinstance(t, torch.Tensor)] for w in weights]
    tensors = [t for m in matrices for t in m]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    as_floats = [t.reshape(-1).view(torch.uint8)[: t.numel() * t.element_size() // 4 * 4].view(torch.float32)
                 for t in tensors]
    one = torch.ones(nbytes // 4, dtype=torch.float32)
    rows = {k: torch.randn(1, k) for k in {w.shape[1] for w in weights}}

    def run_kernels():
        for w in weights:
            kernels.linear(rows[w.shape[1]], w)

    def sum_each():
        for t in as_floats:
            t.sum()

    reader = plain_reader()
    reads = {"kernels": run_kernels, "plain read, one region": lambda: reader.read_matrices(matrices, args.threads),
             "sum each tensor": sum_each, "sum one buffer": one.sum}
    if args.stack:
        reads["stack"] = stack_call(model)
    times = {name: seconds for name, (_, seconds) in interleaved(reads, args.rounds).items()}
    print(f"{os.path.basename(args.model)}: {len(weights)} matrices in {len(tensors)} tensors, {nbytes / 1e6:.0f} MB; "
          f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}, {args.rounds} rounds")
    for name, values in times.items():
        best, median = nbytes / min(values) / 1e9, nbytes / statistics.median(values) / 1e9
        print(f"  {name:22s} best {best:6.1f} GB/s   median {median:6.1f}")


if __name__ == "__main__":
    main()
