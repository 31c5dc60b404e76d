"""Decode of one model file by two or more source trees, in fresh processes alternated.

    python benchmarks/trees_ab.py --model llama-1b-q4_k_m.gguf --trees /work/wt/base,/work/main --rounds 4
    python benchmarks/trees_ab.py --model llama-1b-iq4_xs.gguf --trees 9f1269c,. --engine genfn-compiled
    python benchmarks/trees_ab.py --model SmolLM2-135M-Instruct.Q4_1.gguf --trees bd4b58d,. --engine genfn-avx2

A ``--trees`` entry that is no directory is a git revision of this checkout, exported with ``git
archive`` into a temporary directory for the run.

For a change whose effect lies inside one native call (the layers' stack, a kernel the stack calls),
where an in-process A/B of two op libraries cannot swap it: each round runs every tree once (order
reversed every other round, so a drift of the machine hits both alike) as ``model_bench.py``'s child
process with that tree on ``PYTHONPATH`` and its own kernels (build each tree's first: ``python -m
genfn.kernels build``; the kernel cache keys libraries by their sources, so trees share it). The
child loads the file as ``model_bench.py`` does, warms up and keeps the best of ``--repeats``
decodes of ``--new-tokens`` tokens (a 1-token call's time subtracted), and with ``--prefill N`` the
best prefill of one N-token prompt as well. Prints tok/s, a digest of the decoded tokens and
``tensor.sum``'s read rate beside it (``model_bench.sampled``; the memory's speed moves between
minutes on a VM) per process, each tree's median and best, and each tree's paired ratios over the
first's (decode, and prefill where timed).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from model_bench import ENGINES, run_child, sampled

ROOT = Path(__file__).resolve().parents[1]


def source_tree(entry: str, scratch: str) -> str:
    """A ``--trees`` entry as a directory: a directory as given, else a git revision of this checkout
    exported under ``scratch``."""
    if Path(entry).is_dir():
        return entry
    exported = Path(scratch) / entry.replace("/", "_")
    exported.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", entry], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--trees: {entry!r} is neither a directory nor a git revision of {ROOT}")
    subprocess.run(["tar", "-x", "-C", str(exported)], input=archive.stdout, check=True)
    return str(exported)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file or HF directory")
    ap.add_argument("--trees", required=True,
                    help="comma list of source trees or git revisions; ratios are over the first")
    ap.add_argument("--engine", default="genfn", choices=[e for e in ENGINES if e != "llama.cpp"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed decodes per process (the fastest counts)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=0, help="also time the prefill of a prompt this long (0: none)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per process")
    args = ap.parse_args()
    entries = args.trees.split(",")
    if len(entries) < 2:
        raise SystemExit("--trees: give at least two source trees")
    with tempfile.TemporaryDirectory(prefix="genfn-trees-") as scratch:
        run(args, entries, [source_tree(entry, scratch) for entry in entries])


def run(args, names: list[str], trees: list[str]) -> None:
    """The rounds over ``trees`` (printed by their ``--trees`` names), then the medians and ratios."""
    args.batches = [args.batch]
    phases = ["decode"] + (["prefill"] if args.prefill else [])
    rates: dict[str, dict[str, list[float]]] = {p: {n: [] for n in names} for p in phases}
    for r in range(args.rounds):
        for name, tree in zip(names, trees) if r % 2 == 0 else list(zip(names, trees))[::-1]:
            result = sampled(lambda: run_child(args, args.model, args.engine, tree=tree))
            if "error" in result:
                raise SystemExit(f"{name}: {result['error']}")
            rates["decode"][name].append(result["decode_tok_s"][args.batch])
            prefill = ""
            if args.prefill:
                rates["prefill"][name].append(result["prefill_tok_s"])
                prefill = f"  pp{args.prefill} {result['prefill_tok_s']:.1f} tok/s"
            read = "/".join(f"{gbs:.1f}" for gbs in result["read_gbs"])
            print(f"{name} {result['decode_tok_s'][args.batch]:.1f} tok/s tokens {result['tokens_digest'][args.batch]}"
                  f"{prefill}  tensor.sum before/after {read} GB/s", flush=True)
    for phase in phases:
        for name in names:
            print(f"{phase} {name} median {statistics.median(rates[phase][name]):.1f} "
                  f"best {max(rates[phase][name]):.1f}")
        for name in names[1:]:
            print(f"{phase} paired {name} / {names[0]}:",
                  " ".join(f"{a / b:.3f}" for a, b in zip(rates[phase][name], rates[phase][names[0]])))


if __name__ == "__main__":
    main()
