"""An all-reduce through shared memory for the tensor-parallel ranks of one machine.

gloo reduces over loopback TCP: on the 2-core development VM one all-reduce of SmolLM2's hidden
vector costs 1.1-1.3 ms (``benchmarks/tp.py``), and a decode step makes 2 to 4 of them per layer,
so TP=2 spent most of its token waiting on sockets. Ranks that share a machine can instead share
memory, as vLLM's CPU backend does: every rank writes its partial sums into its own slot of one
mapped file, publishes a sequence number, waits until every rank has published it, and adds the
slots in rank order. The sums are the same bits on every rank (one order, elementwise adds) and,
for the exact quantized path that adds zeros (``tensor_parallel.row_parallel``), one process's.

Layout of the mapping: one 64-byte line of flags per rank (its last published sequence number),
then ``ranks x 2`` data slots of ``capacity`` bytes. Two slots per rank suffice: a rank can only
start reduction ``s + 2`` (which reuses the slot of ``s``) after every rank published ``s + 1``,
which each does only after it finished reading the slots of ``s``.

The ordering argument needs stores to become visible in program order (x86-64's memory model):
the data is written before the flag and read after it, so the mapping is offered on x86-64 only;
elsewhere, across machines, for CUDA tensors or tensors over ``capacity`` the ranks keep using the
process group's own all-reduce. Waiting spins for a moment, then yields the core, then sleeps in
short steps; it raises, naming the rank, when a peer process on this machine is gone or when the
group's timeout passes.

Reducers are registered by process-group name, beside torch's own registry of groups
(``for_group``); ``genfn.distributed`` opens one when it forms the group and closes it on shutdown.
"""

from __future__ import annotations

import os
import platform
import socket
import time
import uuid

import torch

__all__ = ["SharedMemoryAllReduce", "open_for_group", "for_group", "close_all", "DEFAULT_CAPACITY"]

DEFAULT_CAPACITY = 4 << 20  # bytes per slot: a 512-token prefill of a 2048-wide model in float32
_LINE = 64  # bytes: each rank's flag on its own cache line
_FLAG_STRIDE = _LINE // 8
_SPINS = 2000  # polls (~0.3 ms) before yielding the core to others
_YIELDS_BEFORE_SLEEP = 0.01  # seconds of yielding before sleeping between polls
_CHECK_EVERY = 0.1  # seconds between checks that the peers are alive

_reducers: dict[str, "SharedMemoryAllReduce"] = {}


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs (a zombie, e.g. a killed spawned rank that
    its parent has not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


class SharedMemoryAllReduce:
    """Sum a tensor over the ranks of one machine through a shared mapping (see the module
    docstring). Build it with ``open_for_group``; every rank must call ``all_reduce`` with tensors
    of the same shape and dtype in the same order, as with any collective."""

    def __init__(self, buffer: torch.Tensor, rank: int, world_size: int, pids: list[int], capacity: int,
                 timeout: float):
        self.rank, self.world_size, self.capacity, self.timeout = rank, world_size, capacity, timeout
        self._buffer = buffer  # keeps the mapping alive
        self._flags = buffer[:world_size * _LINE].view(torch.int64).numpy()
        self._data = buffer[world_size * _LINE:].view(world_size, 2, capacity)
        self._pids = pids
        self._sequence = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= self.capacity

    def _slot(self, rank: int, slot: int, like: torch.Tensor) -> torch.Tensor:
        size = like.numel() * like.element_size()
        return self._data[rank, slot, :size].view(like.dtype)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of ``tensor`` (contiguous, ``fits``), written into ``tensor`` and
        returned."""
        flat = tensor.view(-1)
        self._sequence += 1
        slot = self._sequence & 1
        self._slot(self.rank, slot, flat).copy_(flat)
        self._flags[self.rank * _FLAG_STRIDE] = self._sequence
        self._wait(self._sequence)
        parts = [self._slot(r, slot, flat) for r in range(self.world_size)]
        torch.add(parts[0], parts[1], out=flat)
        for part in parts[2:]:
            flat.add_(part)
        return tensor

    def _wait(self, sequence: int) -> None:
        flags = self._flags
        start = None
        for r in range(self.world_size):
            polls = 0
            while flags[r * _FLAG_STRIDE] < sequence:
                polls += 1
                if polls < _SPINS:
                    continue
                now = time.monotonic()
                if start is None:
                    start, checked = now, now
                if now - checked > _CHECK_EVERY:
                    checked = now
                    self._check_peer(r, now - start)
                if now - start < _YIELDS_BEFORE_SLEEP:
                    os.sched_yield()
                else:
                    time.sleep(50e-6)

    def _check_peer(self, rank: int, waited: float) -> None:
        if not _alive(self._pids[rank]):
            raise RuntimeError(f"tensor-parallel rank {rank} (pid {self._pids[rank]}) is gone: it ended during "
                               f"an all-reduce")
        if waited > self.timeout:
            raise RuntimeError(f"tensor-parallel rank {rank} did not reach an all-reduce within {self.timeout:.0f} s")


def open_for_group(group=None, *, capacity: int = DEFAULT_CAPACITY, timeout: float = 300.0):
    """Open a shared-memory all-reduce over ``group`` (default: the world) and register it under the
    group's name, when every rank runs on this machine, on x86-64, over gloo, and the mapping can be
    reserved in ``/dev/shm``; else register nothing. A collective: every rank of ``group`` calls it.
    Returns the reducer or None."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world < 2 or dist.get_backend(group) != "gloo":
        return None
    me = (socket.gethostname(), _boot_id(), platform.machine().lower() in ("x86_64", "amd64"), os.getpid())
    everyone: list = [None] * world
    dist.all_gather_object(everyone, me, group=group)
    if not all((host, boot) == everyone[0][:2] and x86 for host, boot, x86, _ in everyone):
        return None
    size = world * _LINE + world * 2 * capacity
    path = [""]
    if rank == 0:
        path[0] = _create(size)
    dist.broadcast_object_list(path, src=dist.get_global_rank(group, 0), group=group)
    buffer = None
    if path[0]:
        try:
            buffer = torch.from_file(path[0], shared=True, size=size, dtype=torch.uint8)
        except (OSError, RuntimeError):
            buffer = None
    mapped: list = [None] * world
    dist.all_gather_object(mapped, buffer is not None, group=group)  # every rank has mapped it past here
    if rank == 0 and path[0]:
        os.unlink(path[0])  # the mappings stay; nothing is left in /dev/shm, even after a crash
    if not all(mapped):
        return None
    reducer = SharedMemoryAllReduce(buffer, rank, world, [pid for *_, pid in everyone], capacity, timeout)
    _reducers[group.group_name] = reducer
    return reducer


def _create(size: int) -> str:
    """A fresh file of ``size`` bytes in /dev/shm, its space reserved (so that touching a page can
    never fault for want of memory), or "" when there is no room."""
    path = f"/dev/shm/genfn-tp-{uuid.uuid4().hex}"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return ""
    try:
        os.posix_fallocate(fd, 0, size)
        return path
    except OSError:
        os.unlink(path)
        return ""
    finally:
        os.close(fd)


def for_group(group_name: str) -> SharedMemoryAllReduce | None:
    """The reducer registered for the process group named ``group_name``, or None."""
    return _reducers.get(group_name)


def close_all() -> None:
    """Forget every reducer (their mappings go with the last reference)."""
    _reducers.clear()
