"""The conveniences a ``Model`` offers beyond its value: ``model.generate`` and transformers'
``ContinuousMixin`` methods (``generate_batch``, ``init_continuous_batching``, ...).

They belong to the public API, not to ``genfn.models``: a model is a value that imports nothing
above it (DESIGN.md's layers), so ``genfn/__init__.py`` attaches these methods to ``Model`` with
:func:`attach_model_methods`. Each imports what it calls on use, so importing genfn does not import
continuous batching.
"""

from __future__ import annotations

__all__ = ["attach_model_methods"]


def generate(self, input_ids=None, generation_config=None, **kwargs):
    """``genfn.generate(self, input_ids, generation_config, **kwargs)``."""
    from genfn.generation import generate as generate_fn

    return generate_fn(self, input_ids, generation_config, **kwargs)


def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None,
                             **manager_options):
    """A ``ContinuousBatchingManager`` for this model (``genfn.batching.api.init_continuous_batching``)."""
    from genfn.batching.api import init_continuous_batching as init_fn

    return init_fn(self, generation_config, continuous_batching_config, workload_hints, **manager_options)


def continuous_batching_context_manager(self, generation_config=None, block=True, timeout=None,
                                        continuous_batching_config=None, persistent_manager=False, warmup=True,
                                        workload_hints=None, **manager_options):
    """A started manager for a ``with`` block (``genfn.batching.api.continuous_batching_context_manager``)."""
    from genfn.batching.api import continuous_batching_context_manager as context_fn

    return context_fn(self, generation_config, block, timeout, continuous_batching_config, persistent_manager, warmup,
                      workload_hints, **manager_options)


def generate_batch(self, inputs, generation_config=None, continuous_batching_config=None, record_timestamps=False,
                   progress_bar=False, persistent_manager=False, warmup=True, **kwargs):
    """Every prompt of ``inputs`` to its end with continuous batching (``genfn.batching.api.generate_batch``)."""
    from genfn.batching.api import generate_batch as batch_fn

    return batch_fn(self, inputs, generation_config, continuous_batching_config, record_timestamps, progress_bar,
                    persistent_manager, warmup, **kwargs)


def destroy_cached_continuous_batching_manager(self) -> None:
    """Destroy the manager a session kept with ``stop(keep_for_next_session=True)``."""
    from genfn.batching.api import destroy_cached_continuous_batching_manager as destroy_fn

    destroy_fn(self)


_METHODS = (generate, init_continuous_batching, continuous_batching_context_manager, generate_batch,
            destroy_cached_continuous_batching_manager)


def attach_model_methods(model_class: type) -> None:
    """Give ``model_class`` (``genfn.Model``) the methods above."""
    for method in _METHODS:
        setattr(model_class, method.__name__, method)
