"""What the first write to fresh anonymous memory costs, per GB, against a second write to it.

    python benchmarks/fresh_memory.py                      # 1 GB, 4 rounds, 5 s apart
    python benchmarks/fresh_memory.py --gb 0.5 --rounds 6 --gap 0

A load that repacks a file's blocks (the Q8_0/Q4_0/Q4_1 tiles) or dequantizes them (the float
load) writes every byte of its weight arena (``genfn.models.weight_arena``) once, into memory the
process never touched. Each round maps ``--gb`` of fresh anonymous memory per variant, in turn
(interleaved; the order reversed every other round, ``--gap`` seconds before each so that memory
freed by the previous one can go back to the host), and times:

    huge        advised MADV_HUGEPAGE (as the arena is), then written by one thread (torch fill_)
    huge-pop    advised MADV_HUGEPAGE, then faulted in by madvise(MADV_POPULATE_WRITE)
    huge-2thr   advised MADV_HUGEPAGE, each half populated by its own thread at once (ctypes' madvise)
    4k          advised MADV_NOHUGEPAGE, written by one thread

and the second write to the same pages. Prints seconds per GB (median and all rounds) and the
load average. Linux only (MADV_POPULATE_WRITE needs Linux 5.14).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import threading
import time

import torch

MADV_POPULATE_WRITE = 23
HUGE_PAGE = 2 << 20


def _populate(address: int, length: int) -> None:
    """madvise(MADV_POPULATE_WRITE) over [address, address + length), without the GIL."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(address, length, MADV_POPULATE_WRITE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")


VARIANTS = ("huge", "huge-pop", "huge-2thr", "4k")


def first_and_second_write(variant: str, nbytes: int) -> tuple[float, float]:
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_NOHUGEPAGE if variant == "4k" else mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(mapping, dtype=torch.uint8)
    start = time.perf_counter()
    if variant == "huge-pop":
        mapping.madvise(MADV_POPULATE_WRITE)
    elif variant == "huge-2thr":
        # Through ctypes, which lets go of the GIL for the call: mmap.madvise holds it, so two
        # threads calling that populate one after the other.
        half = nbytes // 2 // HUGE_PAGE * HUGE_PAGE
        base = memory.data_ptr()
        threads = [threading.Thread(target=_populate, args=(base, half)),
                   threading.Thread(target=_populate, args=(base + half, nbytes - half))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        memory.fill_(1)
    first = time.perf_counter() - start
    start = time.perf_counter()
    memory.fill_(2)
    second = time.perf_counter() - start
    del memory
    mapping.close()
    return first, second


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--gap", type=float, default=5.0, help="seconds of sleep before each mapping")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {VARIANTS}")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if not variants or set(variants) - set(VARIANTS):
        ap.error(f"--variants: choose from {VARIANTS}")
    torch.set_num_threads(1)  # one writer, as the loader's native fill
    nbytes = int(args.gb * 2**30) // mmap.PAGESIZE * mmap.PAGESIZE
    per_gb = nbytes / 1e9
    print(f"# fresh memory, {nbytes / 1e9:.2f} GB a mapping, gap {args.gap} s; uptime: {os.popen('uptime').read().strip()}")
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for round_ in range(args.rounds):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            time.sleep(args.gap)
            results[variant].append(first_and_second_write(variant, nbytes))
    for variant, rows in results.items():
        firsts = [first / per_gb for first, _ in rows]
        seconds = [second / per_gb for _, second in rows]
        print(f"{variant:10s} first write {statistics.median(firsts):.2f} s/GB (all {', '.join(f'{x:.2f}' for x in firsts)}); "
              f"second write {statistics.median(seconds):.2f} s/GB")
    print(f"# uptime at end: {os.popen('uptime').read().strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
