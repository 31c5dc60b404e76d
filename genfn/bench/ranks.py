"""Two local ranks for the tensor-parallel benchmarks (``benchmarks/tp.py``, ``tp_batching.py``)."""

from __future__ import annotations

import socket
from typing import Any, Callable

__all__ = ["run_local_ranks"]


def run_local_ranks(rank_main: Callable, args: Any, world_size: int = 2, timeout: float = 3600.0) -> list[dict]:
    """Start ``rank_main(rank, port, args, results)`` in ``world_size`` spawned processes (a free
    loopback port for their process group) and return the dict each puts on ``results``, by its
    ``"rank"``."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(rank, port, args, results)) for rank in range(world_size)]
    for p in procs:
        p.start()
    reports = sorted((results.get(timeout=timeout) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=120)
    return reports
