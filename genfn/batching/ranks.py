"""Which manager a rank of a tensor-parallel model gets: ``ContinuousBatchingManager(model)`` on a
model sharded over several ranks is rank 0's leader or another rank's follower
(``genfn.batching.tensor_parallel``), with the same API on every rank.

The manager inherits this choice (``RankRoles.__new__``) rather than importing the two classes,
which subclass it: ``genfn.batching.tensor_parallel`` registers them in ``RankRoles.roles`` when
the package is imported.
"""

from __future__ import annotations

from genfn.batching.engine import Engine

__all__ = ["RankRoles", "tensor_parallel_shard"]


def tensor_parallel_shard(model):
    """The model's ``TensorShard`` when it is split over more than one rank, else None."""
    shard = getattr(getattr(model, "spec", None), "tensor_shard", None)
    return shard if shard is not None and shard.world_size > 1 else None


class RankRoles:
    """``cls(model, ...)``: the registered ``"leader"`` class on rank 0 of a sharded model, the
    ``"follower"`` class on the others, ``cls`` itself for a model on one process (or when ``cls``
    already is one of the two). ``_engine_class``: the engine the manager builds."""

    roles: dict = {}
    tensor_parallel_role: str | None = None
    _engine_class = Engine

    def __new__(cls, model=None, *args, **kwargs):
        shard = tensor_parallel_shard(model)
        if shard is not None and cls.tensor_parallel_role is None:
            role = "leader" if shard.rank == 0 else "follower"
            if role not in RankRoles.roles:
                raise RuntimeError("genfn.batching.tensor_parallel is not imported (import genfn.batching)")
            cls = RankRoles.roles[role]
        return super().__new__(cls)
