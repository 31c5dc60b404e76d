"""Native kernels for the memory-bound decode step, built at install time or on first use.

``decode_linear(x, weight)`` is ``F.linear`` for a few rows of ``x`` (a decode step: one row per
sequence), streaming the weight once from memory at close to the machine's read bandwidth
(see ``decode_linear.cpp`` and ``benchmarks/gemv_kernels.py``). ``quant_linear`` is the same for
a block-quantized ``genfn.quant.QuantizedWeight`` (``quant_linear.cpp``: AVX-512 VNNI integer
dot products against the activation quantized to 8 bits). Both are ``torch.library`` ops with
fake implementations, so they sit inside compiled steps like any aten op; ``linear`` picks one
by the weight's type. ``decode_attention`` is one query per row against the dense static cache
(``decode_attention.cpp``, which also holds the paged cache's decode attention and write).
``genfn.kernels.decode_layer`` runs a Llama decoder layer's decode step in two calls around the
cache write (``decode_layer.cpp``).

The C++ sources are compiled with the system C++ compiler by ``pip install`` where the build has
torch and a compiler, else the first time they are needed, into ``$GENFN_KERNEL_CACHE`` (default
``~/.cache/genfn/kernels``); ``genfn kernels build`` builds them now. Each build is named by a key
over the sources, torch's version and the flags (``genfn.kernels.native``, the one loader). Where
they cannot be built or run (no compiler, a CPU without AVX-512, ``GENFN_KERNELS=0``), ``linear``
is ``F.linear`` and the reason is in ``kernel_status()``; the quantized op then runs the K-quant
library's AVX2 kernel of the same tiles, or ``genfn.quant.reference_linear`` (same numbers, far
slower). On a CPU with AVX2 but no AVX-512 the decode kernels' AVX2 build loads instead
(``decode_stack_isa``): the ops ``portable_ops_available`` names, the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from genfn.kernels import native
from genfn.kernels.coded_bf16 import coded_linear, coded_rows, encode_coded_bf16, register_coded_fake
from genfn.quant.coded_bf16 import CodedBfloat16
from genfn.quant.kquants import KQuantWeight
from genfn.quant.stack import RowStack
from genfn.quant.weight import QuantizedWeight

__all__ = ["linear", "embedding", "decode_attention", "prefill_attention", "MIN_PREFILL_QUERIES",
           "decode_linear_available", "portable_ops_available", "decode_library", "decode_stack_isa", "quant_linear_available", "quant_gemm_min_rows", "force_bf16_linear_path", "kernel_status", "needs_build",
           "release_thread_pool", "MAX_DECODE_ROWS", "MAX_LINEAR_ROWS", "coded_linear", "encode_coded_bf16"]

_OP_NAMESPACE = "genfn_kernels"

# Rows of x up to which the kernel beats the library GEMM (benchmarks/gemv_kernels.py step): in
# bfloat16 with vdpbf16ps, CPU time per SmolLM2 step at 4/6/8 rows was 0.49/0.45/0.74 of
# F.linear's (Zen 4, one thread); the widening kernel (CPUs without AVX512_BF16) 0.78/0.83/0.83.
MAX_DECODE_ROWS = {torch.float32: 8, torch.bfloat16: 8}
# The bytes of decode_stack_table's tensor (decode_stack.cpp's kTableBytes: its header).
STACK_TABLE_BYTES = 16

# Rows of x up to which ``linear`` takes the kernel at all: past MAX_DECODE_ROWS it runs its tiles
# of rows over L2-sized panels of the weight, which still streams the weight once. Against F.linear
# on one thread of the Zen 4 (`benchmarks/gemv_kernels.py step float32,bfloat16 8,11,16,32,64
# --threads 1`: a SmolLM2 step's linears), float32 at 11-64 rows took 0.45-0.7 of its time (MKL
# picks its AVX2 code on AMD CPUs), bfloat16 with vdpbf16ps 0.6-0.9 up to 32 rows and about the
# same at 64. A speculative round (the prompt
# lookup's 11 positions), a beam step or a small batch stays a weight stream, not a GEMM. The
# widening bfloat16 kernel (no AVX512_BF16) gains only at a few rows. Read at import: a compiled
# step must not open files while it is traced.
MAX_LINEAR_ROWS = {torch.float32: 64, torch.bfloat16: 32 if native.cpu_has("avx512_bf16") else 8}

_status = "not loaded yet"
# None until the first call of decode_linear_available(); a plain global (not functools.cache)
# so that a compiled step reads it as a constant instead of tracing the loader.
_available: bool | None = None
# Which library holds the stack's ops (decode_stack_isa), set with _available.
_stack_isa: str | None = None


def kernel_status() -> str:
    """Why ``decode_linear`` is or is not in use: ``"loaded from <path>"`` or the reason it is not."""
    decode_linear_available()
    return _status


def needs_build() -> bool:
    """Whether using the kernels would first compile them: no installed or cached build for these
    sources, torch and flags, and a compiler to build one (``False`` once they are loaded)."""
    return _available is None and native.plan(decode_library()).action == "build"


def decode_library() -> native.NativeLibrary:
    """The decode library this process loads: the decode kernels (``native.DECODE``), or on a CPU
    they cannot run on but the decode stack's AVX2 build can (no AVX-512), that build
    (``native.DECODE_AVX2``)."""
    if (native.plan(native.DECODE).action == "unavailable"
            and native.plan(native.DECODE_AVX2).action != "unavailable"):
        return native.DECODE_AVX2
    return native.DECODE


def _register_fake() -> None:
    register_coded_fake(_OP_NAMESPACE)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::bf16_gemm_plain")
    def _(x, weight, bias, out_float32):
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32 if out_float32 else x.dtype)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::bf16_gemm_swiglu")
    def _(x, gate_up):
        return x.new_empty((x.shape[0], gate_up.shape[0] // 2))

    _register_quant_fake()

    @torch.library.register_fake(f"{_OP_NAMESPACE}::decode_attention_input")
    def _(x, norm, wqkv, cos, sin, eps, heads, kv_heads):
        return x.new_empty((x.shape[0], wqkv.shape[0]))

    @torch.library.register_fake(f"{_OP_NAMESPACE}::decode_layer_output")
    def _(x, q, keys, values, visible, wo, mlp_norm, w_gate_up, w_down, eps, scale):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::decode_attention_input_quant")
    def _(x, norm, codes, scales, mins, kind, cos, sin, eps, heads, kv_heads):
        return x.new_empty((x.shape[0], (heads + 2 * kv_heads) * cos.shape[-1]))

    @torch.library.register_fake(f"{_OP_NAMESPACE}::decode_layer_output_quant")
    def _(x, q, keys, values, visible, wo_codes, wo_scales, wo_mins, wo_kind, mlp_norm, gate_up_codes,
          gate_up_scales, gate_up_mins, gate_up_kind, down_codes, down_scales, down_mins, down_kind, eps, scale):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::decode_attention_input_kquant")
    def _(x, norm, wqkv, formats, cos, sin, eps, heads, kv_heads):
        return x.new_empty((x.shape[0], (heads + 2 * kv_heads) * cos.shape[-1]))

    @torch.library.register_fake(f"{_OP_NAMESPACE}::decode_layer_output_kquant")
    def _(x, q, keys, values, visible, wo, wo_formats, mlp_norm, w_gate_up, gate_up_formats, w_down, down_formats,
          eps, scale):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::decode_mlp_input_quant")
    def _(x, mlp_norm, codes, scales, mins, kind, out_features, eps):
        return x.new_empty((x.shape[0], out_features // 2))

    _register_stack_fake()

    @torch.library.register_fake(f"{_OP_NAMESPACE}::moe_decode")
    def _(x, experts, weights, gate_up, down):
        return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((), dtype=torch.int64)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::moe_decode_quant")
    def _(x, experts, weights, gate_up_codes, gate_up_scales, gate_up_mins, gate_up_kind, gate_up_rows, down_codes,
          down_scales, down_mins, down_kind, down_rows):
        return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((), dtype=torch.int64)


def _register_stack_fake() -> None:
    """The fakes of the ops both decode libraries have (``portable_ops_available``): the plain linears,
    the stack, its table, the decode and prefill attention and the token ops."""

    @torch.library.register_fake(f"{_OP_NAMESPACE}::decode_linear")
    def _(x, weight):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake(f"{_OP_NAMESPACE}::invariant_linear")
    def _(x, weight):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake(f"{_OP_NAMESPACE}::dense_decode_attention")
    def _(q, keys, values, visible, scale, softcap=0.0, cache_rows=None):
        return torch.empty_like(q)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::paged_query_attention")
    def _(q, keys, values, tables, lengths, scale, sliding_window, softcap=0.0):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::decode_stack_table")
    def _(weights, layout, dtype, hidden, heads, kv_heads, head_dim):
        device = next(w.device for w in weights if w is not None)
        return torch.empty(STACK_TABLE_BYTES, dtype=torch.uint8, device=device)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::decode_stack")
    def _(x, table, layers, cos, sin, keys, values, slots, visible, eps, scale):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::decode_stack_paged")
    def _(x, table, layers, cos, sin, keys, values, slot_mapping, block_tables, request_index, positions, eps,
          scale, sliding_window):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::prefill_attention")
    def _(q, keys, values, mask, scale, first_slots=None):
        batch, heads, seq, head_dim = q.shape
        return q.new_empty((batch, seq, heads, head_dim)).transpose(1, 2)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::tiles_lookup")
    def _(codes, scales, mins, kind, out_features, index):
        return index.new_empty((index.numel(), codes.shape[1] * 32), dtype=torch.float32)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::paged_write")
    def _(keys, values, layer, slots, k, v):
        return None

    @torch.library.register_fake(f"{_OP_NAMESPACE}::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::add_rms_norm")
    def _(x, delta, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::rope_qkv")
    def _(qkv, cos, sin, heads, kv_heads):
        head_dim = qkv.shape[1] // (heads + 2 * kv_heads)
        return (qkv.new_empty((qkv.shape[0], heads, head_dim)), qkv.new_empty((qkv.shape[0], kv_heads, head_dim)),
                qkv.new_empty((qkv.shape[0], kv_heads, head_dim)))

    @torch.library.register_fake(f"{_OP_NAMESPACE}::silu_mul")
    def _(gate_up):
        return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))

    @torch.library.register_fake(f"{_OP_NAMESPACE}::max_logsumexp")
    def _(logits):
        return logits.new_empty((logits.shape[0],), dtype=torch.int64), logits.new_empty((logits.shape[0],))

    @torch.library.register_fake(f"{_OP_NAMESPACE}::argmax_rows")
    def _(logits):
        return logits.new_empty((logits.shape[0],), dtype=torch.int64)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::propose_prompt_lookup")
    def _(tokens, cur_len, first_column, max_length, eos_token_ids, num_output_tokens, max_matching_ngram_size,
          latest):
        return tokens.new_empty((tokens.shape[0], num_output_tokens)), tokens.new_empty((tokens.shape[0],))


def _register_quant_fake() -> None:
    @torch.library.register_fake(f"{_OP_NAMESPACE}::quant_linear")
    def _(x, codes, scales, mins, kind, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake(f"{_OP_NAMESPACE}::quant_linear_from")
    def _(init, x, codes, scales, mins, kind, out_features):
        return x.new_empty((*x.shape[:-1], out_features))


def decode_linear_available() -> bool:
    """Whether ``torch.ops.genfn_kernels.decode_linear`` is built and loaded (built on first call)."""
    global _available
    if _available is None:
        _available = _load()
    return _available


def _load() -> bool:
    global _status, _stack_isa
    if decode_library() is native.DECODE_AVX2:
        _status = native.plan(native.DECODE).reason
        stack_loaded, stack_status = native.load(native.DECODE_AVX2)
        if stack_loaded:
            _register_stack_fake()
            _stack_isa = "avx2"
            _status += f"; the {native.DECODE_AVX2.what} {stack_status}"
        return False
    loaded, _status = native.load(native.DECODE)
    if loaded:
        _register_fake()
        _stack_isa = "avx512"
    return loaded


def portable_ops_available() -> bool:
    """Whether the ops both decode libraries build are loaded, from the AVX-512 one or, on a CPU without
    AVX-512, the AVX2 one (``decode_stack_isa``), with the same bits: the stack and its table, the decode
    attention (``decode_attention.cpp``), the plain linears (``decode_linear``, ``invariant_linear``) and
    the token ops (``token_ops.cpp``, ``lookup_ops.cpp``), the prefill attention and the GGUF loader's
    tile fill (``gguf_tiles.cpp``). The rest (fused layers, GEMMs, the VNNI tiles) is the AVX-512
    library's alone (``decode_linear_available``)."""
    return decode_stack_isa() is not None


def decode_stack_isa() -> str | None:
    """Which build of the decode stack (``decode_layer.run_stack``) this process runs: ``"avx512"`` (the
    decode library, every op), ``"avx2"`` (``native.DECODE_AVX2``, where the CPU has no AVX-512: the
    stack of tiles16 and K-quant layers and the attention, the same bits) or None."""
    decode_linear_available()
    return _stack_isa


def release_thread_pool() -> bool:
    """Let the calling thread's idle OpenMP worker threads go (``thread_pool.cpp``): call it on a
    thread that hands its torch work to another (continuous batching's caller, before it waits),
    so that the working thread's pool is the process's only one. Returns whether a pool was
    released (``False`` where the kernels are not built or the thread is inside a parallel region)."""
    if not portable_ops_available():
        return False
    return bool(torch.ops.genfn_kernels.release_thread_pool())


def _linear_rows(dtype: torch.dtype) -> int | None:
    """Rows of x up to which ``linear`` takes ``decode_linear`` for weights of ``dtype`` (None: never):
    MAX_LINEAR_ROWS with the AVX-512 library; a decode step's MAX_DECODE_ROWS with the AVX2 build, whose
    panels past them (tiles of 6 x 1) were not measured against the library's GEMM."""
    isa = decode_stack_isa()
    return None if isa is None else (MAX_LINEAR_ROWS if isa == "avx512" else MAX_DECODE_ROWS).get(dtype)


def _takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    limit = _linear_rows(weight.dtype)
    return (
        limit is not None
        and x.dtype == weight.dtype
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and x.shape[-1] == weight.shape[1]
        and x.numel() // max(weight.shape[1], 1) <= limit
        # The op has no backward: anything that will be differentiated takes F.linear.
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the decode kernel when ``x`` has only a few rows;
    a ``QuantizedWeight`` always takes the quantized kernel, a ``KQuantWeight`` the K-quant one
    (``kquant.py``), a ``CodedBfloat16`` the coded one (``coded_bf16.py``), a ``RowStack`` each part's own."""
    if isinstance(weight, QuantizedWeight):
        y = quantized_linear(x, weight)
        return y if bias is None else y + bias
    if isinstance(weight, KQuantWeight):
        y = kquant_linear(x, weight)
        return y if bias is None else y + bias
    if isinstance(weight, CodedBfloat16):
        y = coded_linear(x, weight)
        return y if bias is None else y + bias
    if isinstance(weight, RowStack):  # parts in different formats: each through its own kernel
        y = torch.cat([linear(x, part) for part in weight.parts], dim=-1)
        return y if bias is None else y + bias
    if not _takes(x, weight):
        if _bf16_through_float32(x, weight):
            return _widened_linear(x, weight, bias)
        return F.linear(x, weight, bias)
    y = _decode_linear_op(x, weight)
    return y if bias is None else y + bias


def _bf16_through_float32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a bfloat16 product past the decode kernel's rows (a prefill's GEMM) runs as a float32
    GEMM of the widened values, rounded once: on a CPU without AVX512_BF16, where oneDNN's bfloat16 GEMM
    has no fast form. As an AVX2 CPU (``ONEDNN_MAX_CPU_ISA=AVX2``), SmolLM2's shape prefilled 512 tokens
    at 221 tok/s through it, the 1B shape at 31 (llama.cpp built for AVX2: 738 and 100); an AVX-512 CPU
    without bfloat16 instructions (Skylake-SP to Ice Lake; ``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` on the Zen
    4) ran a 512 x 2048 x 2048 product in 50 ms through oneDNN's emulation, 41 widened
    (``benchmarks/prefill_kernels.py --formats bf16,bf16_torch``). A weight's widening is N x K
    conversions against the GEMM's M x N x K multiply-adds."""
    return (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == weight.device.type == "cpu"
            and (decode_stack_isa() == "avx2" or not native.cpu_has("avx512_bf16")))


# Bytes of float32 weight rows a widened bfloat16 GEMM converts at a time: a panel that stays in the
# cache for its GEMM, where the whole widened matrix went to memory and back.
_WIDEN_PANEL_BYTES = 4 << 20


def _widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of bfloat16 ``x`` and ``weight`` as a float32 GEMM of the widened values, rounded
    once (``_bf16_through_float32``), the weight widened a panel of rows at a time. Widened whole, the
    1B shape's 8192 x 2048 matrices went out to memory as float32 and back: a 512-row product of the
    gate and up projections (16384 x 2048) took 228 ms so, 176-184 ms in panels (Zen 4 as an AVX2 CPU)."""
    out_features, in_features = weight.shape
    rows = max(64, _WIDEN_PANEL_BYTES // (4 * max(in_features, 1)))
    x32 = x.reshape(-1, in_features).float()
    if out_features <= rows:
        y = torch.mm(x32, weight.float().t())
    else:
        y = torch.empty(x32.shape[0], out_features)
        panel = torch.empty(rows, in_features)
        for first in range(0, out_features, rows):
            part = panel[: min(rows, out_features - first)]
            part.copy_(weight[first:first + part.shape[0]])
            y[:, first:first + part.shape[0]] = torch.mm(x32, part.t())
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


def _takes_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> bool:
    batch, heads, seq, head_dim = q.shape
    kv_heads = keys.shape[1]
    return (
        seq == 1
        and q.dtype in (torch.float32, torch.bfloat16)
        and q.dtype == keys.dtype == values.dtype
        and q.device.type == keys.device.type == "cpu"
        and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1
        and mask.shape[0] == batch and mask.shape[3] <= keys.shape[2]
        and head_dim % 16 == 0 and head_dim <= 128
        and heads % kv_heads == 0
        and keys.stride(-1) == 1 and values.stride(-1) == 1 and keys.stride(2) == values.stride(2)
        and not (torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad or values.requires_grad))
        and portable_ops_available()
    )


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """``scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)`` for one
    query per row (``q [B, H, 1, D]``, ``keys``/``values [B, Hkv, A, D]``, boolean ``mask
    [B, 1, 1, A]``), read in place from the dense cache by the native kernel; ``None`` where the
    kernel does not take these arguments (more queries, a dtype, no kernels built), so that the
    caller runs the library attention."""
    if not _takes_attention(q, keys, values, mask):
        return None
    batch, heads, _, head_dim = q.shape
    out = getattr(torch.ops, _OP_NAMESPACE).dense_decode_attention(
        q.reshape(batch, heads, head_dim), keys, values, mask.reshape(batch, mask.shape[3]), head_dim ** -0.5)
    return out.view(batch, heads, 1, head_dim)


# Queries per row from which ``prefill_attention`` takes the native kernel: a prefill's or a
# chunk's. Fewer (a speculative round's drafts, a beam step) stay where they were.
MIN_PREFILL_QUERIES = 17


def _takes_prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                             min_queries: int) -> bool:
    batch, heads, seq, head_dim = q.shape
    return (
        seq >= min_queries
        and q.dtype in (torch.float32, torch.bfloat16) and q.dtype == keys.dtype == values.dtype
        and q.device.type == keys.device.type == values.device.type == "cpu"
        and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
        and mask.shape[0] == batch and mask.shape[2] == seq and mask.shape[3] == keys.shape[2]
        and head_dim % 16 == 0 and head_dim <= 256 and keys.shape[3] == head_dim
        and heads % keys.shape[1] == 0
        and q.stride(-1) == 1 and keys.stride(-1) == 1 and keys.stride() == values.stride()
        and not (torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad or values.requires_grad))
        and portable_ops_available()
    )


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      first_slots: torch.Tensor | None = None, *,
                      min_queries: int = MIN_PREFILL_QUERIES) -> torch.Tensor | None:
    """``scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)`` for many
    queries per row (``q [B, H, S, D]`` float32 or bfloat16, ``S >= min_queries``;
    ``keys``/``values [B, Hkv, A, D]`` of q's dtype, read in place from the dense cache; boolean
    ``mask [B, 1, S, A]``) by the native kernel (``prefill_attention.cpp``), which skips the tiles
    of keys the mask hides: half of a causal prefill's. The result, ``[B, H, S, D]`` of q's dtype,
    lies in ``[B, S, H, D]`` memory. ``first_slots [B]`` (int64): each row's first real slot, where
    its key tiles start, so that a left-padded row gets its prompt's bits alone (default: the first
    slot any query sees; a padding query sees its own). ``min_queries``: the fewest queries a row
    it takes (default MIN_PREFILL_QUERIES; a query's values do not depend on how many there are,
    so a paged chunk of a long prompt passes 1). ``None`` where the kernel does
    not take these arguments, so that the caller runs the library attention."""
    if not _takes_prefill_attention(q, keys, values, mask, min_queries):
        return None
    return getattr(torch.ops, _OP_NAMESPACE).prefill_attention(q, keys, values, mask, q.shape[-1] ** -0.5,
                                                               first_slots)


def _decode_linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return getattr(torch.ops, _OP_NAMESPACE).decode_linear(x, weight)


# ---------------------------------------------------------------------------------------------
# Quantized weights

_FORMAT_OF_KIND = {0: "q4_0", 1: "q4_1", 2: "q8_0", 3: "q5_0", 4: "q5_1"}
# None until the first quantized call: whether quant_linear is the native op or the fallback.
_quant_native: bool | None = None
# Set with it: whether quantized_linear calls the K-quant library's AVX2 kernel of the tiles
# (tiles_avx2.cpp, the same bits): where the decode library has no VNNI kernel to run, on a CPU
# without AVX-512 (it cannot load) or with AVX-512 but no VNNI (it has only a scalar loop).
_tiles_on_avx2 = False


def _define_fallback_op() -> None:
    """``quant_linear`` under the native op's name and schema where the decode library cannot load
    (a CPU without AVX-512, no compiler, ``GENFN_KERNELS=0``): the K-quant library's AVX2 kernel of
    the same tiles (``tiles_avx2.cpp``: quant_linear.cpp's arithmetic, so its bits) where that
    library runs (``_tiles_on_avx2``, set before this is called), else plain torch. Compiled steps and
    eager calls see the same op either way."""
    from genfn.quant.reference import reference_linear

    library = torch.library.Library(_OP_NAMESPACE, "FRAGMENT")
    library.define("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int kind, "
                   "int out_features) -> Tensor")
    library.define("quant_linear_from(Tensor init, Tensor x, Tensor codes, Tensor scales, Tensor? mins, int kind, "
                   "int out_features) -> Tensor")

    def reference(x, codes, scales, mins, kind, out_features):
        if _tiles_on_avx2:
            return torch.ops.genfn_kquant.tiles_linear(x, codes, scales, mins, kind, out_features)
        weight = QuantizedWeight(codes, scales, mins, _FORMAT_OF_KIND[kind], out_features, codes.shape[1] * 32)
        return reference_linear(x, weight, dtype=torch.float32)

    def reference_from(init, x, codes, scales, mins, kind, out_features):
        if _tiles_on_avx2:
            return torch.ops.genfn_kquant.tiles_linear(x, codes, scales, mins, kind, out_features, init)
        return init + reference(x, codes, scales, mins, kind, out_features)  # not the native chain's bits

    library.impl("quant_linear", reference, "CPU")
    library.impl("quant_linear_from", reference_from, "CPU")
    _define_fallback_op.library = library  # the registration lives as long as this object
    _register_quant_fake()


def quant_linear_available() -> bool:
    """Whether the decode library loaded for quantized linears (else ``_define_fallback_op``'s op:
    the K-quant library's AVX2 kernel of the same tiles and bits, or where that cannot run either
    the torch reference, much slower). ``quantized_linear`` takes the AVX2 kernel wherever the
    decode library has no VNNI kernel."""
    global _quant_native, _tiles_on_avx2
    if _quant_native is None:
        loaded = decode_linear_available()
        if not (loaded and native.cpu_has("avx512_vnni")):
            from genfn.kernels import kquant

            _tiles_on_avx2 = kquant.tiles_kernel_runs()
        _quant_native = loaded
        if not _quant_native:
            _define_fallback_op()
    return _quant_native


def quant_gemm_min_rows(rows: int | None) -> int:
    """Set the fewest rows of ``x`` that a Q8_0/Q4_0/Q4_1 product hands to the GEMM
    (``quant_gemm.cpp``, on CPUs with AVX512_VNNI) instead of the row kernels (``None``: the
    default, 16), for tests and benchmarks of either path; returns the count now in force. Both
    give every output the same bits."""
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ValueError(f"rows must be None or a positive int; got {rows!r}")
    if not decode_linear_available():
        raise RuntimeError(f"the native kernels are {_status}")
    return int(getattr(torch.ops, _OP_NAMESPACE).quant_gemm_min_rows(0 if rows is None else rows))


_BF16_PATHS = {None: 0, "widen": 1, "dot": 2}


def force_bf16_linear_path(path: str | None) -> str:
    """Pin the bfloat16 path of ``decode_linear``/``invariant_linear``: ``"widen"`` (the weights
    widened to float32, the path of CPUs without AVX512_BF16), ``"dot"`` (``vdpbf16ps``) or
    ``None`` (the best this CPU has), for tests and benchmarks of the widening path on a CPU that
    has both; returns the path now in force. The decode stack's plain bfloat16 linears follow it too (the
    AVX2 build's bits); coded bfloat16 ones keep ``vdpbf16ps``."""
    if path not in _BF16_PATHS:
        raise ValueError(f"path must be None, 'widen' or 'dot'; got {path!r}")
    if not decode_linear_available():
        raise RuntimeError(f"the native kernels are {_status}")
    active = int(getattr(torch.ops, _OP_NAMESPACE).bf16_linear_path(_BF16_PATHS[path]))
    return {1: "widen", 2: "dot"}[active]


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, init: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.dequantize().T`` with ``x`` quantized per block of 32 to 8 bits (see quant_linear.cpp).

    ``init`` (the output's shape, float32): each output's sum over the blocks starts from it
    rather than from zero, in the kernel's own order, so that blocks split over tensor-parallel
    ranks chain to the bits one process gets (``genfn.models.tensor_parallel.row_parallel``)."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"linear: x has {x.shape[-1]} features, the quantized weight expects {weight.in_features}")
    if init is not None and (init.shape != (*x.shape[:-1], weight.out_features) or init.dtype != torch.float32):
        raise ValueError(f"quantized_linear: init must be float32 of the output's shape "
                         f"{[*x.shape[:-1], weight.out_features]}, got {init.dtype} {list(init.shape)}")
    quant_linear_available()
    if _tiles_on_avx2:
        return torch.ops.genfn_kquant.tiles_linear(x, weight.codes, weight.scales, weight.mins, weight.kind,
                                                   weight.out_features, init)
    ops = getattr(torch.ops, _OP_NAMESPACE)
    if init is None:
        return ops.quant_linear(x, weight.codes, weight.scales, weight.mins, weight.kind, weight.out_features)
    return ops.quant_linear_from(init, x, weight.codes, weight.scales, weight.mins, weight.kind, weight.out_features)


def kquant_linear(x: torch.Tensor, weight: KQuantWeight, *, row_kernels: bool = False) -> torch.Tensor:
    """``x @ weight.dequantize().T`` with ``x`` quantized per 256 inputs (32 for iq4_nl) to 8 bits
    (see kquant_linear.cpp; ``row_kernels``: ``genfn.kernels.kquant.kquant_linear``'s)."""
    from genfn.kernels.kquant import kquant_linear as native

    return native(x, weight, row_kernels=row_kernels)


def embedding(tokens: torch.Tensor, table, dtype: torch.dtype) -> torch.Tensor:
    """``F.embedding(tokens, table)`` as ``dtype``; a quantized table (a GGUF file's K-quant
    embedding kept as stored, ``KQuantWeight``, or Q8_0/Q4_0/Q4_1 blocks in the kernel's tiles,
    ``QuantizedWeight``: a tied LM head's own) is read row by row: the looked-up rows' blocks
    gathered and dequantized, never the whole table (a token of a tied head's interleaved K-quant
    rows, ``q6_k_r8`` and the like, reads its own row out of its group of 8)."""
    if isinstance(table, CodedBfloat16):  # a tied head's coded table: the looked-up rows decoded
        return coded_rows(table, tokens).to(dtype)
    if isinstance(table, KQuantWeight):
        from genfn.kernels.kquant import kquant_lookup

        return kquant_lookup(table, tokens.reshape(-1)).view(*tokens.shape, table.in_features).to(dtype)
    if isinstance(table, QuantizedWeight):
        if table.codes.is_cpu and tokens.device.type == "cpu" and portable_ops_available():
            # QuantizedWeight.lookup's values in one native pass (gguf_tiles.cpp's tiles_lookup).
            rows = getattr(torch.ops, _OP_NAMESPACE).tiles_lookup(table.codes, table.scales, table.mins, table.kind,
                                                                  table.out_features, tokens.reshape(-1))
            return rows.view(*tokens.shape, table.in_features).to(dtype)
        return table.lookup(tokens).to(dtype)
    return F.embedding(tokens, table)
