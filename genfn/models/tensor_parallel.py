"""Tensor parallelism for the native decoder families: one model split over the ranks of a
``torch.distributed`` process group (Megatron's layout).

Each rank holds a slice of every layer: q/k/v and gate/up split by output rows (column-parallel:
a rank computes its own attention heads and its own part of the MLP), o and down split by input
columns (row-parallel: each rank's product is a partial sum of the layer's output, and one
all-reduce adds them before the residual add), the embedding and LM head split by vocabulary rows
(each token's embedding comes from the rank that holds its row; each rank computes the logits of
its rows and one all-reduce assembles the whole vocabulary's on every rank, so processors and
token choice run unchanged and every rank picks the same token). The KV cache holds the rank's
heads only. Norms and rotary tables are replicated; a norm after a row-parallel linear (OLMo 2's
and Gemma's post-norms) runs after the all-reduce, on the whole hidden vector. Per-head norms
(Qwen3, Gemma 3) go with the heads; a norm over a whole projection's heads (OLMo 2's q/k norms)
has its weight cut with the heads and its mean square summed over the ranks (``mean_squares``).
Phi-3's fused q/k/v and gate/up matrices are cut part by part (a rank's heads' rows of each of
q, k and v; its slice of each of gate and up). What only changes per head or per layer (partial
rotary, LongRoPE, layers without RoPE, sliding windows, Gemma's soft-capping and scaled
embedding) needs nothing: Gemma's final logit soft-cap is applied to the gathered logits.

A mixture of experts (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS; ``genfn.models.moe``) keeps its router
whole on every rank (every rank routes every token alike) and splits every expert's intermediate
size as the MLP's: each rank holds rows ``[i0, i1)`` of each expert's gate and up and those input
columns of its down, runs the chosen experts on its slice, and one all-reduce after the MoE block
sums the ranks' partial outputs. GPT-OSS's biases follow the same cut: q/k/v's and the gate/up
experts' are sliced with their rows, each head's attention sink goes with its head, and the
row-parallel o and down biases are kept whole on every rank and added once, after the all-reduce
(``row_parallel(..., bias=)``; the MoE adds its routed down biases the same way).

Heads go to the ranks in whole key/value groups, as evenly as they divide: a model with 3 KV
heads over 2 ranks gives one rank 2 groups and the other 1 (SmolLM2-135M has 3). A model with
fewer KV heads than ranks is refused (its heads would have to be replicated).

A family supports tensor parallelism by keeping a ``tensor_shard`` field (None: one process) in
its spec and calling ``embedding``, ``row_parallel`` (or ``reduced``), ``mean_squares`` and
``gathered_logits`` where its forward meets a split; ``shard_params`` here builds a rank's spec
and params from a Hugging Face state dict.
Inside a ``torch.compile``d step the collectives are torch's traceable functional collectives;
in the eager loop, the cheaper in-place ``dist.all_reduce``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from genfn import kernels, local_all_reduce

from genfn.quant.blocks import BLOCK, RowBlocks
from genfn.quant.fuse import cat_rows
from genfn.quant.experts import QuantizedExperts
from genfn.quant.weight import QuantizedWeight

__all__ = ["TensorShard", "SPLIT_FAMILIES", "Pieces", "current_shard", "shard_spec", "slice_plan", "shard_state_dict",
           "shard_params", "cut_pieces", "embedding", "reduced", "mean_squares", "row_parallel", "gathered_logits",
           "vocab_range", "head_range"]


# The families whose layers split (what the refusals name).
SPLIT_FAMILIES = ("Llama, Mistral, Qwen2, Qwen3, SmolLM3, OLMo 2, Phi-3 / Phi-4-mini, Gemma 2 / Gemma 3, "
                  "Qwen3-MoE, Mixtral, OLMoE, GPT-OSS")


@dataclasses.dataclass(frozen=True)
class TensorShard:
    """Which slice of the model this process holds: its ``rank`` of ``world_size`` in the process
    group named ``group_name`` (static: it is part of the spec that keys compiled steps)."""

    rank: int
    world_size: int
    group_name: str

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")


def current_shard(group=None) -> TensorShard:
    """The ``TensorShard`` of this process in ``group`` (default: the world of the initialized
    process group); a clear error when torch.distributed has not been initialized."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tensor parallelism needs an initialized torch.distributed process group: launch with "
                           "`torchrun --nproc-per-node N ...` or call genfn.distributed.init_tensor_parallel()")
    group = group if group is not None else dist.group.WORLD
    return TensorShard(dist.get_rank(group), dist.get_world_size(group), group.group_name)


def _split(total: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``total`` (a multiple of ``unit``) is cut into
    ``parts`` contiguous pieces of whole units, as evenly as they divide."""
    units = total // unit
    return (units * index // parts) * unit, (units * (index + 1) // parts) * unit


def head_range(spec, shard: TensorShard) -> tuple[int, int]:
    """The KV heads ``[start, stop)`` this rank holds (its query heads are their groups)."""
    if spec.num_kv_heads < shard.world_size:
        raise ValueError(f"tensor parallelism over {shard.world_size} ranks needs at least that many key/value "
                         f"heads (num_key_value_heads={spec.num_kv_heads}); use --tp <= {spec.num_kv_heads}")
    return _split(spec.num_kv_heads, shard.world_size, shard.rank)


def _splits_moe_size(spec) -> bool:
    """Whether the experts' size is a field of its own (Qwen3-MoE, Mixtral, OLMoE: ``moe_intermediate_size``);
    GPT-OSS's ``intermediate_size`` is each expert's."""
    return bool(getattr(spec, "num_experts", 0)) and hasattr(spec, "moe_intermediate_size")


def _mlp_size(spec) -> int:
    """The intermediate size the ranks split: each expert's in a mixture of experts, else the MLP's."""
    return spec.moe_intermediate_size if _splits_moe_size(spec) else spec.intermediate_size


def _intermediate_unit(spec, world_size: int) -> int:
    # The down projection is cut along its inputs: whole quantization groups (64 for int4) when
    # the size allows, so a quantized matrix splits between its blocks.
    size = _mlp_size(spec)
    for unit in (64, BLOCK):
        if size % unit == 0 and size // unit >= world_size:
            return unit
    return 1


def vocab_range(vocab_size: int, shard: TensorShard) -> tuple[int, int]:
    """The vocabulary rows ``[start, stop)`` of this rank's embedding and LM head: equal slices of
    ``ceil(vocab / world)`` rows (the last may be shorter), so the gathered logits need no reordering."""
    per = -(-vocab_size // shard.world_size)
    start = min(vocab_size, per * shard.rank)
    return start, min(vocab_size, start + per)


def shard_spec(spec, shard: TensorShard):
    """The spec of this rank's slice: its heads, its part of the MLP, ``tensor_shard`` set.
    ``vocab_size`` stays the whole vocabulary (the gathered logits have it)."""
    if not hasattr(spec, "tensor_shard"):
        raise ValueError(f"{type(spec).__name__} has no tensor-parallel support (no tensor_shard field)")
    kv_start, kv_stop = head_range(spec, shard)
    groups = spec.num_heads // spec.num_kv_heads
    unit = _intermediate_unit(spec, shard.world_size)
    size = _mlp_size(spec)
    i_start, i_stop = _split(size, shard.world_size, shard.rank, unit)
    if i_stop <= i_start:
        what = "moe_intermediate_size" if _splits_moe_size(spec) else "intermediate_size"
        raise ValueError(f"{what}={size} is too small to split over {shard.world_size} ranks")
    # A mixture of experts splits every expert's intermediate size (Qwen3-MoE's intermediate_size
    # is a dense MLP's it does not have, and stays).
    sizes = dict(intermediate_size=i_stop - i_start)
    if _splits_moe_size(spec):
        sizes = dict(moe_intermediate_size=i_stop - i_start,
                     **(sizes if spec.intermediate_size == spec.moe_intermediate_size else {}))
    return dataclasses.replace(spec, num_heads=(kv_stop - kv_start) * groups, num_kv_heads=kv_stop - kv_start,
                               tensor_shard=shard, **sizes)


def _narrow(tensor, dim: int, start: int, stop: int, name: str):
    """Rows (``dim=0``) or input columns (``dim=1``) ``[start, stop)`` of a float tensor or of
    ``RowBlocks`` (whole blocks: a quantized matrix is split between its blocks, never inside one)."""
    if not isinstance(tensor, RowBlocks):
        return tensor.narrow(dim, start, stop - start).contiguous()
    if dim == 0:
        return tensor.map_rows(lambda part: part[start:stop])
    group = tensor.group_size
    if start % group or stop % group:
        raise ValueError(f"{name}: a {tensor.format} matrix splits only between its blocks of {group} inputs; "
                         f"columns [{start}, {stop}) cut a block (pick a --tp that divides the layer into whole blocks)")
    mins = None if tensor.mins is None else tensor.mins[:, start // group:stop // group].contiguous()
    return RowBlocks(tensor.format, tensor.codes[:, start // BLOCK:stop // BLOCK].contiguous(),
                     tensor.scales[:, start // group:stop // group].contiguous(), mins)


# What a plan gives for a tensor: the pieces ``(dim, start, stop)`` this rank keeps, concatenated
# along their dim: one piece for most tensors, one per part for a fused matrix (Phi-3's
# ``qkv_proj`` rows ``[q | k | v]`` and ``gate_up_proj`` rows ``[gate | up]``: a rank keeps its
# heads' rows of each part and its slice of each half).
Pieces = tuple[tuple[int, int, int], ...]


def _narrow_pieces(tensor, pieces, name: str):
    """``_narrow`` for each of ``pieces``, joined along their dim (``cat_rows`` for quantized rows). A
    GGUF file's quantized experts are sliced as the file is read, never here."""
    if isinstance(tensor, QuantizedExperts):
        raise ValueError(f"{name}: quantized experts are split as a GGUF file is read: load the model with "
                         "genfn.load(path, quantize='gguf', tensor_shard=...)")
    parts = [_narrow(tensor, *piece, name=name) for piece in cut_pieces(pieces)]
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(part, torch.Tensor) for part in parts):
        return torch.cat(parts, dim=pieces[0][0])
    return cat_rows(parts)


def _plan(spec, local, shard: TensorShard) -> Callable[[str], Pieces | None]:
    """name -> the ``Pieces`` of the tensor this rank keeps, or None for a replicated tensor."""
    kv_start, _ = head_range(spec, shard)
    groups = spec.num_heads // spec.num_kv_heads
    d = spec.head_dim
    q_rows, kv_rows = spec.num_heads * d, spec.num_kv_heads * d
    heads = (kv_start * groups, kv_start * groups + local.num_heads)
    q = (heads[0] * d, heads[1] * d)
    kv = (kv_start * d, (kv_start + local.num_kv_heads) * d)
    mlp = _split(_mlp_size(spec), shard.world_size, shard.rank, _intermediate_unit(spec, shard.world_size))
    vocab = vocab_range(spec.vocab_size, shard)

    def rows(*ranges, offsets=(0, 0, 0)):
        return tuple((0, start + offset, stop + offset) for (start, stop), offset in zip(ranges, offsets))

    rules = {"self_attn.q_proj": rows(q), "self_attn.k_proj": rows(kv), "self_attn.v_proj": rows(kv),
             "self_attn.qkv_proj": rows(q, kv, kv, offsets=(0, q_rows, q_rows + kv_rows)),
             "self_attn.o_proj": ((1, *q),), "mlp.gate_proj": rows(mlp), "mlp.up_proj": rows(mlp),
             "mlp.gate_up_proj": rows(mlp, mlp, offsets=(0, spec.intermediate_size)),
             "mlp.down_proj": ((1, *mlp),), "embed_tokens": rows(vocab), "lm_head": rows(vocab)}
    if getattr(spec, "qk_norm", None) == "projection":  # OLMo 2: one weight per projection row, cut with the heads
        rules.update({"self_attn.q_norm": rows(q), "self_attn.k_norm": rows(kv)})

    interleaved = getattr(spec, "experts_gate_up_interleaved", False)

    def plan(name: str):
        if ".mlp.experts." in name:
            return _expert_cut(name, _mlp_size(spec), *mlp, interleaved=interleaved)
        if ("." + name).endswith((".self_attn.sinks", ".self_attn.sinks.weight")):  # GPT-OSS: one per query head
            return rows(heads)
        stem, _, kind = name.rpartition(".")
        for key, pieces in rules.items():
            if ("." + stem).endswith("." + key):
                return None if (kind == "bias" and pieces[0][0] == 1) else pieces
        return None
    return plan


def _expert_cut(name: str, size: int, start: int, stop: int, interleaved: bool = False):
    """The slice of a stacked expert projection a rank keeps: each expert's intermediate rows
    ``[start, stop)`` of gate and of up (column-parallel), its down's input columns (row-parallel).
    transformers 5 stores gate and up fused per expert (``experts.gate_up_proj [E, 2I, H]``: two
    pieces, concatenated); a GGUF file stacks each projection alone (``[E, I, H]``, ``[E, H, I]``).
    ``interleaved``: GPT-OSS's transformers layout, ``gate_up_proj [E, H, 2I]`` with gate j and up j
    in columns 2j and 2j + 1 (one run of columns keeps the pairs the clamped SwiGLU joins) and
    ``down_proj [E, I, H]``. The down biases (GPT-OSS) are whole on every rank: added after the sum."""
    if name.endswith(("experts.down_proj_bias", "experts.down_proj.bias")):
        return None
    if interleaved and name.endswith("experts.gate_up_proj"):
        return ((2, 2 * start, 2 * stop),)
    if interleaved and name.endswith("experts.gate_up_proj_bias"):
        return ((1, 2 * start, 2 * stop),)
    if interleaved and name.endswith("experts.down_proj"):
        return ((1, start, stop),)
    if name.endswith("experts.gate_up_proj"):
        return ((1, start, stop), (1, size + start, size + stop))
    if name.endswith(("experts.down_proj", "experts.down_proj.weight")):
        return ((2, start, stop),)
    if name.endswith(("experts.gate_proj.weight", "experts.up_proj.weight",
                      "experts.gate_proj.bias", "experts.up_proj.bias")):
        return ((1, start, stop),)
    raise ValueError(f"{name}: not a stacked expert projection tensor parallelism knows how to split")


def cut_pieces(cut) -> list[tuple[int, int, int]]:
    """A plan's cut as its pieces ``[(dim, start, stop), ...]`` (concatenated along ``dim``): one,
    or two for a fused gate/up stack (``_expert_cut``)."""
    return [cut] if isinstance(cut[0], int) else list(cut)


def slice_plan(spec, shard: TensorShard) -> Callable[[str], Pieces | None]:
    """``name -> pieces`` (``Pieces``: ``(dim, start, stop)`` slices, concatenated along their dim)
    of the checkpoint's tensor ``name`` (a Hugging Face name, with or without its ``model.`` prefix)
    this rank keeps, or None for a tensor it keeps whole: what the loaders read
    (``load_checkpoint(..., shard_plan=...)``) so that a rank never reads the others' slices.
    ``spec`` is the whole model's; refuses what ``shard_spec`` refuses."""
    return _plan(spec, shard_spec(spec, shard), shard)


def shard_state_dict(spec, state_dict: Mapping[str, Any], shard: TensorShard) -> dict[str, Any]:
    """This rank's slices of a Hugging Face state dict (float tensors or ``RowBlocks``), under the
    same names; replicated tensors (norms) are kept whole. ``spec`` is the whole model's."""
    plan = slice_plan(spec, shard)
    out = {}
    for name, tensor in state_dict.items():
        pieces = plan(name)
        out[name] = tensor if pieces is None else _narrow_pieces(tensor, pieces, name)
    return out


def shard_params(family, spec, state_dict: Mapping[str, Any], shard: TensorShard, dtype=None, *,
                 sliced: bool = False):
    """``(local spec, params)`` of this rank from the whole model's ``spec`` and its state dict
    (``sliced=True``: a state dict that already holds only this rank's slices)."""
    local = shard_spec(spec, shard)
    if not sliced:
        state_dict = shard_state_dict(spec, state_dict, shard)
    start, stop = vocab_range(spec.vocab_size, shard)
    # The family builds params against its rows of the vocabulary; the spec the forward sees keeps
    # the whole vocabulary, which the gathered logits have.
    params = family.params_from_state_dict(dataclasses.replace(local, vocab_size=stop - start), state_dict, dtype=dtype)
    return local, params


# ---------------------------------------------------------------------------------------------
# The collectives a sharded forward calls (each a no-op for a spec without a tensor_shard)


def _functional():
    import torch.distributed._functional_collectives as funcol

    return funcol


def reduced(spec, partial: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of a row-parallel linear's partial output (one all-reduce).

    Inside a compiled step: torch's traceable functional all-reduce. Eagerly, in place on
    ``partial`` (the caller's own fresh output): through shared memory when the group's ranks share
    this machine (``genfn.local_all_reduce``: microseconds where gloo's loopback TCP takes a
    millisecond), else ``dist.all_reduce``, which cost a third of the functional one's time per
    call (0.40 vs 1.16 ms for SmolLM2's hidden vector on a loaded machine, benchmarks/tp.py)."""
    shard = spec.tensor_shard
    if shard is None:
        return partial
    if torch.compiler.is_compiling():
        funcol = _functional()
        return funcol.wait_tensor(funcol.all_reduce(partial, "sum", shard.group_name))
    import torch.distributed as dist

    partial = partial.contiguous()  # both reduce dense buffers only
    local = local_all_reduce.for_group(shard.group_name)
    if local is not None and local.fits(partial):
        return local.all_reduce(partial)
    dist.all_reduce(partial, group=dist.distributed_c10d._resolve_process_group(shard.group_name))
    return partial


def mean_squares(spec, parts: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Each part's float32 mean square over its last axis (``[..., 1]``), for parts whose last axis
    is split over the ranks (OLMo 2's q and k projections, normed over all their heads).

    Under tensor parallelism each rank holds its heads' part of the axis: the ranks add their rows'
    partial sums of squares, and their parts' lengths, in one all-reduce for every part together;
    the mean is the sum over the whole axis divided by its length. (A float32 sum in another order:
    it differs from one process's mean by rounding only.) On one process: ``mean(-1)``."""
    squares = [part.to(torch.float32).pow(2) for part in parts]
    if spec.tensor_shard is None:
        return [square.mean(-1, keepdim=True) for square in squares]
    lengths = [torch.full_like(square[..., 0], square.shape[-1]) for square in squares]
    sums = reduced(spec, torch.stack([square.sum(-1) for square in squares] + lengths, dim=-1))
    count = len(parts)
    return [sums[..., i:i + 1] / sums[..., count + i:count + i + 1] for i in range(count)]


def row_parallel(spec, x: torch.Tensor, weight, linear: Callable = kernels.linear, bias=None) -> torch.Tensor:
    """``linear(x, weight)`` of a row-parallel weight (o, down: this rank holds its input columns
    and ``x`` their values), summed over the ranks; on one process, just the linear. ``bias`` (whole
    on every rank) is added once, to the sum (on one process: ``linear(x, weight, bias)``).

    A block-quantized weight with float32 activations is summed in one process's order: rank r's
    kernel starts every output's sum where rank r - 1's ended (``quantized_linear(..., init)``),
    one all-reduce per rank handing the running sums on (the others add zeros: exact). The result
    is one process's, bit for bit. Summed in another order, the outputs differ by float rounding
    only, but the next linear rounds its input to 8 bits a value: a rounding difference that moves
    one value across a code's boundary changes it by a whole code, and such changes grow through
    the layers (SmolLM2's Q4_1 logits: up to ~1.2 apart, docs/guides/distributed.md). The price:
    the ranks take turns on these two linears, and a layer makes ``2 x ranks`` all-reduces.
    Other weights: each rank's partial product (``linear``: the caller's, e.g. the packed forward's
    GEMM over a repacked float weight) and one all-reduce (float rounding only).
    """
    shard = spec.tensor_shard
    if shard is None:
        return linear(x, weight) if bias is None else linear(x, weight, bias)
    if not (isinstance(weight, QuantizedWeight) and x.dtype == torch.float32):
        total = reduced(spec, linear(x, weight))
    else:
        total = None
        for rank in range(shard.world_size):
            if rank == shard.rank:
                mine = kernels.quantized_linear(x, weight, total)
            else:
                mine = x.new_zeros((*x.shape[:-1], weight.out_features))
            total = reduced(spec, mine)
    return total if bias is None else total + bias


def embedding(spec, tokens: torch.Tensor, table, dtype: torch.dtype) -> torch.Tensor:
    """``genfn.kernels.embedding`` (a quantized table read row by row), over a vocabulary split by
    rows: each rank looks up the tokens it holds (zeros for the others) and one all-reduce
    assembles the rows (adding zeros is exact)."""
    shard = spec.tensor_shard
    if shard is None:
        return kernels.embedding(tokens, table, dtype)
    start, stop = vocab_range(spec.vocab_size, shard)
    local = tokens - start
    mine = (local >= 0) & (local < stop - start)
    rows = kernels.embedding(local.clamp(0, stop - start - 1), table, dtype)
    rows = rows * mine.unsqueeze(-1).to(rows.dtype)
    return reduced(spec, rows)


def gathered_logits(spec, logits: torch.Tensor) -> torch.Tensor:
    """The whole vocabulary's logits ``[N, vocab]`` from this rank's ``[N, rows]`` (its slice of
    the LM head's rows), on every rank.

    Each rank places its slice at its offset in zeros and one all-reduce sums them: each logit is
    one rank's value plus zeros, exactly that value. (An all-gather moves fewer bytes, but
    inductor's C++ wrapper, which the compiled CPU step uses, cannot call it in torch 2.13.)
    """
    shard = spec.tensor_shard
    if shard is None:
        return logits
    start, stop = vocab_range(spec.vocab_size, shard)
    return reduced(spec, F.pad(logits, (start, spec.vocab_size - stop)))
