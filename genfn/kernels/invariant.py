"""The batch-invariant mode: ``with genfn.deterministic(): ...``.

In the mode a request's logits are bitwise the same whatever else runs beside it: the batch size,
its row, the other requests, where chunked prefill cut its prompt, whether its prefix came from
the prefix cache, the number of threads. That holds because every reduction a token's logits go
through is done per token, by one thread, in an order that depends on the token alone:

- linears: ``linear`` runs all the rows in one call of genfn's own kernel, whose per-row result
  does not depend on the row count (float32/bfloat16: ``invariant_linear`` in
  ``decode_linear.cpp``, each output element one dot product in the decode kernel's fixed order,
  the weight streamed once for all rows in panels that stay in L2; Q8_0/Q4_0/Q4_1 and the
  K-quants: the quantized kernels, each activation row quantized on its own and summed block by
  block, the weight streamed once for all rows). Never oneDNN/MKL, whose blocking and
  k-splitting follow the shape;
- attention: every query, prefill or decode, through the decode attention's per-query walk
  (``decode_attention.cpp``'s ``attend_rows_at``): its visible keys in position order, one thread
  per (query, kv head). ``dense_attention`` reads the static cache, ``paged_attention`` the paged
  cache of continuous batching; both reduce alike, so ``generate`` and continuous batching give
  the same bits;
- RMSNorm, RoPE, SwiGLU: the native per-row ops (``token_ops.cpp``); the LM head the same linear.

The mode is a ``ContextVar``: the model forwards read it (``batch_invariant()``) when they run or
are traced, and ``deterministic()`` restores the previous value on exit. A compiled graph bakes in
the mode it was traced under, so genfn keys its compiled steps on the mode as well
(``genfn.compile_boundary``), and continuous batching fixes it per manager (its forwards run on the
manager's own thread, which a ``ContextVar`` does not reach: the manager reads the mode when it
is built).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from genfn import kernels
from genfn.kernels.packed_gemm import PackedWeight
from genfn.quant.kquants import KQuantWeight
from genfn.quant.stack import RowStack
from genfn.quant.weight import QuantizedWeight
from genfn.torch_compat import constant_result

__all__ = ["deterministic", "batch_invariant", "require_native", "refuse_without_invariant_forward",
           "no_invariant_forward", "INVARIANT_FAMILIES", "mode_for_manager", "linear", "rms_norm", "add_rms_norm",
           "rope_qkv", "silu_mul", "dense_attention", "paged_attention"]

_MODE: contextvars.ContextVar[bool] = contextvars.ContextVar("genfn_batch_invariant", default=False)


# Dynamo cannot trace a ContextVar read; read while tracing, the mode is a constant of the graph
# (no guard: genfn keys its compiled steps on the mode instead, genfn.compile_boundary).
@constant_result
def batch_invariant() -> bool:
    """Whether the calling context is in the batch-invariant mode."""
    return _MODE.get()


def require_native() -> None:
    """Refuse the mode where genfn's native kernels are not built: the library GEMMs it would fall
    back to reduce in a shape-dependent order."""
    if not kernels.portable_ops_available():
        raise RuntimeError(f"the batch-invariant mode needs genfn's native kernels, which are "
                           f"{kernels.kernel_status()}")


# The families whose layers run in the mode (genfn.models.invariant_layers, gemma_invariant); every
# architecture of genfn.models.registry but GPT-OSS (tests/test_deterministic_mode.py checks the list).
INVARIANT_FAMILIES = ("Llama, Mistral, Qwen2, SmolLM2, SmolLM3, Qwen3, OLMo 2, Phi-3/Phi-4-mini, Qwen3-MoE, Mixtral, "
                      "OLMoE, Gemma 2, Gemma 3")
_NOT_INVARIANT = "GPT-OSS, T5, BART, a wrapped module (genfn.from_module), tensor parallelism"


def no_invariant_forward(what: str, remedy: str = "run it outside the mode") -> str:
    """The mode's refusal of ``what``: which families run in it, which do not, and ``remedy``."""
    return (f"the batch-invariant mode (genfn.deterministic, batch_invariant=True) runs {INVARIANT_FAMILIES} on one "
            f"process; {what} has no invariant forward yet (none of {_NOT_INVARIANT} has): {remedy}")


def refuse_without_invariant_forward(family: str) -> None:
    """In the mode, refuse a forward that has no invariant path (it would reduce in shape-dependent
    orders and silently break the mode's promise); outside it, nothing."""
    if batch_invariant():
        raise ValueError(no_invariant_forward(family))


def mode_for_manager(configured: bool) -> bool:
    """A batching manager's mode: its config's ``batch_invariant`` or the context it is built in
    (its forwards run on its own thread, which the context does not reach)."""
    enabled = bool(configured) or batch_invariant()
    if enabled:
        require_native()
    return enabled


@contextlib.contextmanager
def deterministic(enabled: bool = True):
    """Run the enclosed model calls in the batch-invariant mode (``enabled=False``: outside it,
    e.g. to turn it off inside an enclosing ``deterministic()``). Restores the previous mode on exit."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if enabled:
        require_native()
    token = _MODE.set(enabled)
    try:
        yield
    finally:
        _MODE.reset(token)


# ---------------------------------------------------------------------------------------------
# The mode's kernels


def _check_plain(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not (x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu"):
        raise ValueError(f"the batch-invariant mode runs float32 or bfloat16 weights on the CPU with activations of "
                         f"the same dtype; got x {x.dtype} on {x.device.type}, weight {weight.dtype}")


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, *, out_float32: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose every row is computed as if it were alone, all rows in
    one call of genfn's kernels (see the module's docstring). ``weight``: plain, quantized, a
    ``RowStack`` or a ``PackedWeight`` (its plain weight is used)."""
    if isinstance(weight, PackedWeight):
        weight = weight.weight
    if isinstance(weight, RowStack):
        y = torch.cat([linear(x, part) for part in weight.parts], dim=-1)
    else:
        rows = x.reshape(-1, x.shape[-1])
        with torch.no_grad() if rows.requires_grad else contextlib.nullcontext():
            if isinstance(weight, KQuantWeight):  # one path at every row count: the row kernels
                y = kernels.kquant_linear(rows, weight, row_kernels=True)
            elif isinstance(weight, QuantizedWeight):
                y = kernels.linear(rows, weight)
            else:
                _check_plain(x, weight)
                y = torch.ops.genfn_kernels.invariant_linear(rows, weight)
        y = y.reshape(*x.shape[:-1], -1)
    if bias is not None:
        y = y + bias
    return y.to(torch.float32) if out_float32 else y


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x [..., H]`` on its own (``token_ops.cpp``)."""
    return torch.ops.genfn_kernels.rms_norm(_rows(x), weight, eps).view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(x + delta, rms_norm(x + delta))`` row by row."""
    total, normed = torch.ops.genfn_kernels.add_rms_norm(_rows(x), _rows(delta), weight, eps)
    return total.view(x.shape), normed.view(x.shape)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int):
    """``qkv [T, (heads + 2 kv_heads) D]`` split into ``q [T, heads, D]``, ``k``, ``v [T, kv_heads, D]``
    with q and k rotated at each token's ``cos, sin [T, D]``."""
    return torch.ops.genfn_kernels.rope_qkv(qkv.contiguous(), cos.contiguous(), sin.contiguous(), heads, kv_heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return torch.ops.genfn_kernels.silu_mul(gate_up.contiguous())


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    cache_rows: torch.Tensor | None = None, scale: float | None = None,
                    softcap: float = 0.0) -> torch.Tensor:
    """Every query of ``q [B, S, H, D]`` against the keys/values ``[C, Hkv, A, D]`` of its cache row
    (``cache_rows [B]``: q's row ``b`` reads cache row ``cache_rows[b]``; default ``b``, with C == B)
    that ``mask [B, 1, S, A]`` (bool) shows it, each query on its own: ``[B * S, H, D]``. ``scale``:
    of the scores, default ``head_dim ** -0.5``; ``softcap > 0``: scores soft-capped."""
    batch, seq, heads, head_dim = q.shape
    scale = head_dim ** -0.5 if scale is None else scale
    attend = torch.ops.genfn_kernels.dense_decode_attention
    if cache_rows is None:
        if seq == 1:
            return attend(q.reshape(batch, heads, head_dim), keys, values, mask.reshape(batch, -1), scale, softcap)
        cache_rows = torch.arange(batch, device=q.device)
    # One call for every query: a row's S queries read its cache in place (cache_rows), no copies.
    return attend(q.reshape(batch * seq, heads, head_dim), keys, values, mask.reshape(batch * seq, -1), scale, softcap,
                  cache_rows.repeat_interleave(seq))


def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                    request_index: torch.Tensor, positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Query ``t`` of ``q [T, H, D]`` against positions ``0 .. positions[t]`` of its request's
    blocks (``block_tables[request_index[t]]``) in one layer's paged ``keys``/``values [blocks, Hkv,
    block_size, D]``, each on its own, as ``dense_attention`` reduces: ``[T, H, D]``."""
    tables = block_tables.index_select(0, request_index)
    return torch.ops.genfn_kernels.paged_query_attention(q, keys, values, tables, positions + 1,
                                                          q.shape[-1] ** -0.5, sliding_window or 0)
