"""The processes of a tensor-parallel run: joining or starting the ranks, their threads, and
failing loudly when one of them goes.

Two ways in, one result (an initialized ``torch.distributed`` process group whose world is the
tensor-parallel group, gloo on CPU and NCCL on CUDA):

- launched by ``torchrun`` (one or several nodes), each process reads torchrun's environment
  (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...);
- ``spawn_ranks(n, argv)``: the calling process becomes rank 0 and starts ranks 1..n-1 as
  ``python -m genfn <argv>`` children on this machine (the ``genfn ... --tp N`` command line).

Rank 0 is the controller: it alone prints and streams. Every rank runs the same computation on
the same inputs with the same keys, so every rank chooses the same tokens.

Faults: each rank beats a counter in the group's store every second, and a watchdog thread on
each rank watches the others. A rank that raises writes its error to the store first; a rank
whose counter stops (killed, hung, stopped) is named after ``heartbeat_timeout`` seconds; the
survivors then raise ``TensorParallelError`` naming it (the watchdog ends a process blocked in a
collective with exit status 1, since a blocked collective cannot be interrupted). Collectives
also carry the process group's timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import torch

from genfn import local_all_reduce

__all__ = ["TensorParallelError", "init_tensor_parallel", "spawn_ranks", "launched_by_torchrun", "threads_per_rank",
           "report_failure", "shutdown", "fail", "decided_by_rank0", "from_rank0", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 300.0  # seconds a collective may wait (a first compile on a busy machine is slow)
HEARTBEAT_TIMEOUT = 30.0  # seconds without a beat before a rank is declared gone
_BEAT = "genfn/beat/{}"
_FAILED = "genfn/failed"
_FINISHED = "genfn/finished"


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel run died, hung or raised; the message names it."""


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def threads_per_rank(local_ranks: int) -> int:
    """Intra-op threads for one of ``local_ranks`` ranks on this machine, so that together they
    use each core once (two ranks each spinning an OpenMP team over every core slow each other)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: str | None) -> str:
    cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


class _Watchdog:
    """Beats this rank's counter and watches the others'; on a silent or failed peer it reports
    the rank and ends this process (see the module docstring)."""

    def __init__(self, store, rank: int, world: int, heartbeat_timeout: float, on_failure):
        self.store, self.rank, self.world = store, rank, world
        self.heartbeat_timeout = heartbeat_timeout
        self.on_failure = on_failure
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"genfn-tp-watchdog-{rank}", daemon=True)
        self.thread.start()

    def _run(self):
        seen = {r: (-1, time.monotonic()) for r in range(self.world) if r != self.rank}
        while not self.stopped.wait(1.0):
            try:
                self.store.add(_BEAT.format(self.rank), 1)
                if self.store.check([_FAILED]):
                    message = self.store.get(_FAILED).decode()
                    if not message.startswith(f"rank {self.rank}:"):
                        return self._fail(message)
                now = time.monotonic()
                for r, (count, since) in seen.items():
                    current = self.store.add(_BEAT.format(r), 0)
                    if current != count:
                        seen[r] = (current, now)
                    elif now - since > self.heartbeat_timeout:
                        return self._fail(f"rank {r} stopped responding (no heartbeat for "
                                          f"{self.heartbeat_timeout:.0f} s: killed, hung or stopped)")
            except Exception as err:  # the store lives on rank 0: unreachable means rank 0 is gone
                if self.stopped.is_set():
                    return
                return self._fail(f"rank 0 is gone (its store is unreachable: {err})")

    def _fail(self, message: str):
        if not self.stopped.is_set():
            self.on_failure(f"tensor-parallel rank {self.rank}: {message}")

    def stop(self):
        self.stopped.set()


_state: dict = {}


def _default_on_failure(message: str) -> None:
    print(f"genfn: error: {message}", file=sys.stderr, flush=True)
    for child in _state.get("children", ()):
        with contextlib.suppress(OSError):
            child.kill()
    os._exit(1)


def init_tensor_parallel(world_size: int | None = None, *, rank: int | None = None, init_method: str | None = None,
                         device: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                         heartbeat_timeout: float = HEARTBEAT_TIMEOUT, set_threads: bool = True, on_failure=None,
                         shared_memory: bool = True):
    """Join (or, with ``rank`` and ``init_method``, form) the tensor-parallel process group and
    return this process's ``genfn.models.tensor_parallel.TensorShard``.

    Under torchrun every argument comes from its environment (``world_size``, when given, must
    equal ``WORLD_SIZE``). ``timeout``: seconds a collective waits for a peer. ``set_threads``:
    give this process ``threads_per_rank`` intra-op threads (``torch.set_num_threads``; the
    environment is left alone). ``on_failure(message)``: what the watchdog does when a peer goes
    (default: print the message and end the process with status 1). ``shared_memory``: reduce
    through shared memory between the ranks of one machine (``genfn.local_all_reduce``; gloo
    otherwise, and always across machines).
    """
    import torch.distributed as dist

    from genfn.models.tensor_parallel import current_shard

    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized; call shutdown() first")
    options = dict(backend=_backend(device), timeout=datetime.timedelta(seconds=timeout))
    if init_method is None:
        if not launched_by_torchrun():
            raise ValueError("init_tensor_parallel() without init_method needs torchrun's environment (RANK, "
                             "WORLD_SIZE, MASTER_ADDR, MASTER_PORT): launch with `torchrun --nproc-per-node N`")
        found = int(os.environ["WORLD_SIZE"])
        if world_size is not None and world_size != found:
            raise ValueError(f"--tp {world_size} does not match torchrun's world size {found} "
                             f"(--nnodes x --nproc-per-node); pass --tp {found}")
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", found))
        dist.init_process_group(**options)
    else:
        if rank is None or world_size is None:
            raise ValueError("init_method needs rank and world_size")
        local_ranks = world_size
        dist.init_process_group(init_method=init_method, rank=rank, world_size=world_size, **options)
    if set_threads:
        torch.set_num_threads(threads_per_rank(local_ranks))
    shard = current_shard()
    if shard.world_size > 1:
        if shared_memory:
            local_all_reduce.open_for_group(timeout=timeout)
        store = dist.distributed_c10d._get_default_store()
        _state["on_failure"] = on_failure or _default_on_failure
        _state["watchdog"] = _Watchdog(store, shard.rank, shard.world_size, heartbeat_timeout, _state["on_failure"])
    return shard


def report_failure(message: str) -> None:
    """Tell the other ranks (through the store) what failed, so that their errors name the rank
    (``message`` starts with ``rank N``); the first report stands."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):
        dist.distributed_c10d._get_default_store().compare_set(_FAILED, "", message)


def fail(error: BaseException):
    """A collective of a background thread failed (a rank died, or a peer's error broke the group):
    report the clearest account of it (``explain``) and hand it to the group's ``on_failure``
    (default: print ``genfn: error: tensor-parallel rank N ...`` and end the process with status 1,
    ending spawned ranks too). Raises ``TensorParallelError`` when ``on_failure`` returns, or when
    the group was not formed by ``init_tensor_parallel``."""
    on_failure = _state.get("on_failure")
    if on_failure is None:
        raise error
    message = explain(error)
    report_failure(message)
    on_failure(f"tensor-parallel {message}")
    raise TensorParallelError(message) from error


def decided_by_rank0(shard, flag: bool, device=None) -> bool:
    """Rank 0's ``flag`` on every rank of ``shard``'s group (one broadcast): a decision taken on
    a host clock (``max_time``) must be the same on every rank, or one rank stops while the
    others wait in the next step's collectives. ``shard`` None: ``flag`` itself."""
    if shard is None or shard.world_size == 1:
        return flag
    import torch.distributed as dist

    value = torch.tensor([int(bool(flag))], dtype=torch.int64, device=device)
    group = dist.distributed_c10d._resolve_process_group(shard.group_name)
    dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
    return bool(value.item())


def from_rank0(shard, value, device=None):
    """Rank 0's ``value`` (any picklable object) on every rank of ``shard``'s group (one
    broadcast): what rank 0 alone reads (a chat's next line from standard input, a batch's input
    file) reaches every rank, which then run the same computation. ``shard`` None: ``value``."""
    if shard is None or shard.world_size == 1:
        return value
    import torch.distributed as dist

    box = [value]
    group = dist.distributed_c10d._resolve_process_group(shard.group_name)
    on_cuda = device is not None and torch.device(device).type == "cuda"
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group,
                               device=torch.device(device) if on_cuda else None)
    return box[0]


def shutdown(wait_children: float = 30.0) -> None:
    """Stop the watchdog, destroy the process group and wait for (then end) spawned ranks."""
    import torch.distributed as dist

    _state.pop("on_failure", None)
    local_all_reduce.close_all()
    watchdog = _state.pop("watchdog", None)
    if watchdog is not None:
        watchdog.stop()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            # Rank 0 hosts the store: it waits (briefly) until every rank has stopped its watchdog,
            # which would otherwise take the store's closing for rank 0's death.
            store = dist.distributed_c10d._get_default_store()
            store.add(_FINISHED, 1)
            deadline = time.monotonic() + 10.0
            while (dist.get_rank() == 0 and store.add(_FINISHED, 0) < dist.get_world_size()
                   and time.monotonic() < deadline):
                time.sleep(0.05)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    deadline = time.monotonic() + wait_children
    for child in _state.pop("children", ()):
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=10)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn_ranks(world_size: int, argv: list[str], **options):
    """Become rank 0 of ``world_size`` ranks on this machine, starting ranks 1.. as
    ``python -m genfn <argv>`` children (each reads its rank from torchrun's variables in its own
    environment; the caller's is not touched). Returns this process's ``TensorShard``.
    ``options`` go to ``init_tensor_parallel``."""
    port = _free_port()
    children = []
    for rank in range(1, world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        children.append(subprocess.Popen([sys.executable, "-m", "genfn", *argv], env=env, preexec_fn=preexec,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
    _state["children"] = children
    try:
        return init_tensor_parallel(world_size, rank=0, init_method=f"tcp://127.0.0.1:{port}", **options)
    except BaseException:
        for child in children:
            child.kill()
        raise


def explain(error: BaseException) -> str:
    """The clearest account of a failed rank: the error a peer reported to the store, a spawned
    rank's exit status, else this rank's own error."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else None
    for other, child in enumerate(_state.get("children", ()), start=1):
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = child.wait(timeout=2.0)
            if code:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                return f"rank {other} {how}"
    with contextlib.suppress(Exception):
        store = dist.distributed_c10d._get_default_store()
        if store.check([_FAILED]):
            message = store.get(_FAILED).decode()
            if not message.startswith(f"rank {rank}:"):
                return message
        silent = _silent_ranks(store, dist.get_world_size(), rank)
        if silent:
            return f"rank {', '.join(map(str, silent))} stopped (its heartbeat ended: killed, hung or stopped)"
    return f"rank {rank}: {type(error).__name__}: {error}"


def _silent_ranks(store, world: int, rank: int, seconds: float = 3.0) -> list[int]:
    """The other ranks whose heartbeat does not move for ``seconds``."""
    before = {r: store.add(_BEAT.format(r), 0) for r in range(world) if r != rank}
    time.sleep(seconds)
    return [r for r, count in before.items() if store.add(_BEAT.format(r), 0) == count]


def run_command(world_size: int, argv: list[str], command) -> int:
    """Run a command line's ``command(rank)`` as one of ``world_size`` tensor-parallel ranks
    (joining torchrun's group, or spawning ranks 1.. on this machine); rank 0 alone writes to
    stdout. Returns the command's exit status, or 1 with a ``genfn: error:`` line naming the rank
    that failed."""
    shard = init_tensor_parallel(world_size) if launched_by_torchrun() else spawn_ranks(world_size, argv)
    try:
        if shard.rank == 0:
            return command(0)
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            return command(shard.rank)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:
        if type(err).__name__ == "UserError":  # the same mistake on every rank: the command line reports it
            raise
        message = explain(err)
        report_failure(message)
        print(f"genfn: error: tensor-parallel {message}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutdown()
