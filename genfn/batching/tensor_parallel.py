"""Continuous batching under tensor parallelism: rank 0 leads, the other ranks follow.

``ContinuousBatchingManager(model)`` on a model split over several ranks (``genfn.load(...,
tensor_shard=...)``) is a ``LeaderManager`` on rank 0 and a ``FollowerManager`` on the others
(``genfn.batching.ranks``); every rank makes the same calls (``warmup``, ``start``, ``stop``).
Rank 0 is the controller: its manager owns the scheduler, the requests, the token choice and the
results, exactly as on one process (``add_request`` returns the id there and ``None`` on the other
ranks, whose ``get_result`` has nothing to give). What the ranks must do together is the sharded
forward (its all-reduces) and every change of the KV cache, each rank on its own heads' slice, so
rank 0 broadcasts each of those as a command just before running it, and every other rank runs
the same command on its slice:

- ``build``: a paged cache and engine of rank 0's sizes (sized on rank 0: a rank's own sizing
  would see its own number of KV heads, and the ranks' block tables must agree);
- ``forward``: a step's packed inputs (``BatchInputs``, sent as one int64 buffer) and its
  ``PackedPlan``; every rank runs the packed forward, rank 0 alone reads the logits;
- ``clear`` / ``copy``: blocks zeroed (a request whose logits were NaN) or copied (a beam fork);
- ``noop``: sent after ``KEEPALIVE_S`` seconds without a command, while the followers wait in a
  collective that carries the process group's timeout (an idle server would otherwise time out);
- ``stop``: rank 0's loop ended (``stop()``, an error): the followers' session ends with it.

Tokens are chosen on rank 0 alone, not replayed on every rank: the followers then need none of a
request's settings (processor chains, keys, grammar matchers, stop strings: host objects, some
bound to a tokenizer), the schedule is decided once, and the logits rank 0 chooses from are the
all-reduced whole vocabulary, as in ``generate`` under TP. A follower holds no request, so it
cannot diverge from rank 0. The cost is one broadcast of the step's inputs (three small
collectives) per step. Classifier-free guidance runs (its unconditional branch is a row of the
packed batch); drafting over the sharded layers (early exit, a sharded draft model) is refused,
since rank 0 drafts alone beside the batch (``genfn.batching.settings``).

A failed command or forward means a rank is gone (killed, crashed, or its process group broke):
``genfn.distributed.fail`` names the rank and, by default, ends the process with status 1 (a
spawned rank dies with its parent; torchrun stops the others), as ``genfn --tp`` does for
``generate``. A follower's ``stop()`` waits for rank 0's loop to end; SIGINT is for rank 0.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import torch

from genfn.batching.engine import Engine, require_packed_forward
from genfn.batching.inputs import BatchInputs
from genfn.batching.manager import ContinuousBatchingManager
from genfn.batching.ranks import RankRoles

__all__ = ["Channel", "FollowerManager", "LeaderEngine", "LeaderManager", "KEEPALIVE_S", "receive"]

KEEPALIVE_S = 5.0  # seconds without a command before rank 0 sends a noop


def _dist():
    import torch.distributed as dist

    return dist


def guarded(fn, *args):
    """``fn(*args)``, a failure of which (a collective) goes to ``genfn.distributed.fail``."""
    try:
        return fn(*args)
    except Exception as error:
        from genfn.distributed import fail

        fail(error)


def _header(header, device: torch.device):
    box = [header]
    _dist().broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    return box[0]


def pack(tensors, device: torch.device) -> tuple[torch.Tensor | None, tuple]:
    """Integer or bool ``tensors`` as one int64 buffer and their ``(shape, dtype name)`` layout."""
    if not tensors:
        return None, ()
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            raise TypeError(f"a command carries integer or bool tensors, got {t.dtype}")
    layout = tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors)
    return torch.cat([t.reshape(-1).to(device=device, dtype=torch.int64) for t in tensors]), layout


def unpack(buffer: torch.Tensor, layout) -> list[torch.Tensor]:
    out, start = [], 0
    for shape, dtype in layout:
        count = math.prod(shape)
        out.append(buffer[start:start + count].reshape(shape).to(getattr(torch, dtype)))
        start += count
    return out


def receive(device) -> tuple[str, object, list[torch.Tensor]]:
    """A follower's next command from rank 0: ``(op, meta, tensors)`` (blocks until one comes)."""
    device = torch.device(device)
    op, meta, layout = _header(None, device)
    tensors = []
    if layout:
        buffer = torch.empty(sum(math.prod(shape) for shape, _ in layout), dtype=torch.int64, device=device)
        _dist().broadcast(buffer, src=0)
        tensors = unpack(buffer, layout)
    return op, meta, tensors


class Channel:
    """Rank 0's commands to the other ranks, broadcast in order under one lock (a forward's
    all-reduces must not interleave with a keepalive's broadcast: hold ``lock`` across a command
    and the forward it announces). ``open``: a session is running (the followers listen), between
    the first command after a ``stop`` and the next ``stop``; a keepalive thread runs meanwhile."""

    def __init__(self, device, keepalive: float = KEEPALIVE_S):
        self.device = torch.device(device)
        self.lock = threading.RLock()
        self.keepalive = keepalive
        self.open = False
        self._last = time.monotonic()
        self._thread: threading.Thread | None = None

    def send(self, op: str, meta=None, tensors=()) -> None:
        with self.lock:
            buffer, layout = pack(tensors, self.device)
            guarded(_header, (op, meta, layout), self.device)
            if buffer is not None:
                guarded(_dist().broadcast, buffer, 0)
            self._last = time.monotonic()
            self.open = op != "stop"
            if self.open and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._beat, name="genfn-tp-keepalive", daemon=True)
                self._thread.start()

    def _beat(self) -> None:
        while True:
            time.sleep(self.keepalive / 5)
            with self.lock:
                if not self.open:
                    return
                if time.monotonic() - self._last >= self.keepalive:
                    self.send("noop")


def _fields(inputs: BatchInputs) -> tuple[list[str], list[torch.Tensor]]:
    names = [f.name for f in dataclasses.fields(inputs)]
    return names, [getattr(inputs, name) for name in names]


class LeaderEngine(Engine):
    """Rank 0's engine: every forward and every change of the cache is first broadcast to the other
    ranks, which run the same on their slices (the module docstring)."""

    def __init__(self, model, cache, **options):
        super().__init__(model, cache, **options)
        self.channel = Channel(self.device)
        self.channel.send("build", dict(num_blocks=cache.num_blocks, block_size=cache.block_size, **options))

    def forward(self, inputs: BatchInputs, plan=None) -> torch.Tensor:
        names, tensors = _fields(inputs)
        with self.channel.lock:
            self.channel.send("forward", (names, plan), tensors)
            return guarded(super().forward, inputs, plan)

    def clear_blocks(self, blocks) -> None:
        if blocks:
            with self.channel.lock:
                self.channel.send("clear", list(blocks))
                super().clear_blocks(blocks)

    def copy_blocks(self, copies) -> None:
        if copies:
            with self.channel.lock:
                self.channel.send("copy", list(copies))
                super().copy_blocks(copies)


class LeaderManager(ContinuousBatchingManager):
    """Rank 0's manager: the manager of one process over a ``LeaderEngine``; its loop opens the
    followers' session as it starts and ends it (``stop``) as it ends, whatever ended it."""

    tensor_parallel_role = "leader"
    _engine_class = LeaderEngine

    def _run(self, inference_mode: bool) -> None:
        channel = self.engine.channel  # start() built the engine
        channel.send("noop")  # the session is open: the keepalive runs while the loop idles
        try:
            super()._run(inference_mode)
        finally:
            channel.send("stop")

    def destroy(self) -> None:
        channel = getattr(self.engine, "channel", None)
        super().destroy()
        if channel is not None and channel.open:  # built (warmup) but never run: end the followers' session
            channel.send("stop")


class FollowerManager(ContinuousBatchingManager):
    """A rank's manager other than rank 0's: it holds no request (``add_request`` returns None);
    ``warmup()`` / ``start()`` start a thread that runs rank 0's commands on this rank's slice
    until rank 0's loop ends; ``stop()`` waits for that."""

    tensor_parallel_role = "follower"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.follower_engine: Engine | None = None  # rank 0's build command makes it (kept across sessions)

    def _build(self) -> None:
        """Nothing: rank 0's ``build`` command sizes this rank's cache and engine."""

    def warmup(self) -> None:
        self.start()  # rank 0's warm-up forwards are commands like any other
        self.warmed_up = True

    def start(self) -> None:
        if not self.is_running():
            super().start()

    def add_sequences(self, *args, **kwargs) -> list:
        return [None]

    def _loop_once(self) -> bool:
        op, meta, tensors = guarded(receive, self.model.device)
        if op == "stop":
            return False
        if op == "build":
            meta = dict(meta)
            cache = require_packed_forward(self.model).init_packed_cache(
                self.model.spec, meta.pop("num_blocks"), meta.pop("block_size"), dtype=self.model.dtype,
                device=self.model.device)
            self.follower_engine = None  # the old cache goes first
            self.follower_engine = Engine(self.model, cache, **meta)
        elif op == "forward":
            names, plan = meta
            guarded(self.follower_engine.forward, BatchInputs(**dict(zip(names, tensors))), plan)
        elif op == "clear":
            self.follower_engine.clear_blocks(meta)
        elif op == "copy":
            self.follower_engine.copy_blocks(meta)
        return True

    def destroy(self) -> None:
        super().destroy()
        self.follower_engine = None


RankRoles.roles.update(leader=LeaderManager, follower=FollowerManager)
