"""Native kernels for the memory-bound decode step, built when a model is loaded (or on first use).

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

The C++ source is compiled with the system C++ compiler the first time it is needed and cached
under ``$GENFN_KERNEL_CACHE`` (default ``~/.cache/genfn/kernels``), keyed by the source, torch's
version and the flags. Where it cannot be built or run (no compiler, a CPU without AVX-512,
``GENFN_KERNELS=0``), ``linear`` is ``F.linear`` and the reason is in ``kernel_status()``; the
quantized op then runs ``genfn.quant.reference_linear`` (same numbers, far slower).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from genfn.quant.kquants import KQuantWeight
from genfn.quant.stack import RowStack
from genfn.quant.weight import QuantizedWeight

__all__ = ["linear", "embedding", "decode_attention", "decode_linear_available", "quant_linear_available",
           "kernel_status", "needs_build", "release_thread_pool", "MAX_DECODE_ROWS"]

_SOURCES = tuple(Path(__file__).with_name(name) for name in ("decode_linear.cpp", "quant_linear.cpp",
                                                                 "decode_attention.cpp", "decode_layer.cpp",
                                                                 "token_ops.cpp", "thread_pool.cpp",
                                                                 "bf16_gemm.cpp", "moe_decode.cpp"))
# Included by the sources: part of the build's key, not of the command line.
_HEADERS = (Path(__file__).with_name("decode_kernels.h"),)
_OP_NAMESPACE = "genfn_kernels"
_BUILD_TIMEOUT_S = 600
_logger = logging.getLogger(__name__)

# Rows of x up to which the kernel beats the library GEMM (benchmarks/gemv_kernels.py step): in
# bfloat16 with vdpbf16ps, CPU time per SmolLM2 step at 4/6/8 rows was 0.49/0.45/0.74 of
# F.linear's (Zen 4, one thread); the widening kernel (CPUs without AVX512_BF16) 0.78/0.83/0.83.
MAX_DECODE_ROWS = {torch.float32: 8, torch.bfloat16: 8}

_status = "not loaded yet"
# None until the first call of decode_linear_available(); a plain global (not functools.cache)
# so that a compiled step reads it as a constant instead of tracing the loader.
_available: bool | None = None


def kernel_status() -> str:
    """Why ``decode_linear`` is or is not in use: ``"loaded from <path>"`` or the reason it is not."""
    decode_linear_available()
    return _status


def _cache_dir() -> Path:
    return Path(os.environ.get("GENFN_KERNEL_CACHE") or Path.home() / ".cache" / "genfn" / "kernels")


def _compiler() -> str:
    return os.environ.get("CXX") or "c++"


def _compile_command(output: Path, sources=_SOURCES,
                     isa_flags=("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma")) -> list[str]:
    from torch.utils import cpp_extension

    compiler = _compiler()
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib_dirs = cpp_extension.library_paths()
    return [
        compiler, "-O3", "-std=c++20", "-shared", "-fPIC", "-w",
        *isa_flags, "-fopenmp",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *includes, *map(str, sources), "-o", str(output),
        *[f"-L{d}" for d in lib_dirs], "-lc10", "-ltorch_cpu",
        # Resolve OpenMP and torch's libraries to the ones this torch ships, so the kernel's
        # parallel regions run on torch's thread pool rather than a second OpenMP runtime.
        *[f"-Wl,-rpath,{d}" for d in lib_dirs],
    ]


def _command(output: Path, sources, isa_flags) -> list[str]:
    return _compile_command(output, sources) if isa_flags is None else _compile_command(output, sources, isa_flags)


def _library_path(stem: str = "decode_linear", sources=None, headers=None, isa_flags=None) -> Path:
    """Where the library ``stem`` built from these sources (default: the decode kernels', read at
    call time), this torch and these flags is cached."""
    sources, headers = (_SOURCES if sources is None else sources), (_HEADERS if headers is None else headers)
    key = hashlib.sha256()
    for source in (*sources, *headers):
        key.update(source.read_bytes())
    key.update(torch.__version__.encode())
    key.update(" ".join(_command(Path("out.so"), sources, isa_flags)).encode())
    return _cache_dir() / f"{stem}-{key.hexdigest()[:16]}.so"


def needs_build() -> bool:
    """Whether using the kernels would first compile them (no cached build for these sources,
    torch and flags; ``False`` when they are turned off or already loaded)."""
    if _available is not None or os.environ.get("GENFN_KERNELS", "1") == "0":
        return False
    return not _library_path().exists()


def _build(stem: str = "decode_linear", sources=None, headers=None, isa_flags=None) -> Path:
    """Path of the compiled library ``stem`` of ``sources``, compiling it if this source/torch/flags
    has no build yet (``isa_flags`` None: the AVX-512 flags of the decode kernels)."""
    if shutil.which(_compiler()) is None:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    sources = _SOURCES if sources is None else sources
    target = _library_path(stem, sources, headers, isa_flags)
    cache = target.parent
    cache.mkdir(parents=True, exist_ok=True)
    if target.exists():  # built: no need to queue behind another process's build of other sources
        return target
    # One process builds; the others wait on the lock and then find the library.
    with open(cache / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            # Say so: the one-time build is about a minute of g++ and would otherwise look like a hang.
            _logger.info("building the native kernels into %s (once; about a minute of g++ on an idle machine, "
                         "then cached)", cache)
            start = time.perf_counter()
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            done = subprocess.run(_command(partial, sources, isa_flags), capture_output=True, text=True,
                                  timeout=_BUILD_TIMEOUT_S)
            if done.returncode != 0:
                partial.unlink(missing_ok=True)
                raise RuntimeError(f"compiling {', '.join(s.name for s in sources)} failed:\n{done.stderr[-2000:]}")
            partial.replace(target)
            _logger.info("built the native kernels in %.1f s", time.perf_counter() - start)
    return target


def _register_fake() -> None:
    @torch.library.register_fake(f"{_OP_NAMESPACE}::decode_linear")
    def _(x, weight):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    _register_quant_fake()

    @torch.library.register_fake(f"{_OP_NAMESPACE}::paged_decode_attention")
    def _(q, keys, values, tables, lengths, scale, sliding_window):
        return torch.empty_like(q)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::dense_decode_attention")
    def _(q, keys, values, visible, scale):
        return torch.empty_like(q)

    @torch.library.register_fake(f"{_OP_NAMESPACE}::paged_query_attention")
    def _(q, keys, values, tables, lengths, scale, sliding_window):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

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

    @torch.library.register_fake(f"{_OP_NAMESPACE}::paged_write")
    def _(keys, values, layer, slots, k, v):
        return None

    _register_token_ops_fake()

    @torch.library.register_fake(f"{_OP_NAMESPACE}::moe_decode")
    def _(x, experts, weights, gate_up, down):
        return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((), dtype=torch.int64)


def _register_token_ops_fake() -> None:
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


def _register_quant_fake() -> None:
    @torch.library.register_fake(f"{_OP_NAMESPACE}::quant_linear")
    def _(x, codes, scales, mins, kind, out_features):
        return x.new_empty((*x.shape[:-1], out_features))


def decode_linear_available() -> bool:
    """Whether ``torch.ops.genfn_kernels.decode_linear`` is built and loaded (built on first call)."""
    global _available
    if _available is None:
        _available = _load()
    return _available


def _load() -> bool:
    global _status
    if os.environ.get("GENFN_KERNELS", "1") == "0":
        _status = "disabled by GENFN_KERNELS=0"
        return False
    if sys.platform != "linux" or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        _status = f"needs an x86-64 CPU with AVX-512 on Linux (this: {sys.platform}, " \
                  f"{torch.backends.cpu.get_cpu_capability()})"
        return False
    try:
        path = _build()
        torch.ops.load_library(str(path))
        _register_fake()
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        _status = f"unavailable: {error}"
        warnings.warn(f"genfn: decode kernels {_status}; using F.linear", RuntimeWarning, stacklevel=2)
        return False
    _status = f"loaded from {path}"
    return True


def release_thread_pool() -> bool:
    """Let the calling thread's idle OpenMP worker threads go (``thread_pool.cpp``): call it on a
    thread that hands its torch work to another (continuous batching's caller, before it waits),
    so that the working thread's pool is the process's only one. Returns whether a pool was
    released (``False`` where the kernels are not built or the thread is inside a parallel region)."""
    if not decode_linear_available():
        return False
    return bool(torch.ops.genfn_kernels.release_thread_pool())


def _takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    limit = MAX_DECODE_ROWS.get(weight.dtype)
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
        and decode_linear_available()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the decode kernel when ``x`` has only a few rows;
    a ``QuantizedWeight`` always takes the quantized kernel, a ``KQuantWeight`` the K-quant one
    (``kquant.py``), a ``RowStack`` each part's own."""
    if isinstance(weight, QuantizedWeight):
        y = quantized_linear(x, weight)
        return y if bias is None else y + bias
    if isinstance(weight, KQuantWeight):
        y = kquant_linear(x, weight)
        return y if bias is None else y + bias
    if isinstance(weight, RowStack):  # parts in different formats: each through its own kernel
        y = torch.cat([linear(x, part) for part in weight.parts], dim=-1)
        return y if bias is None else y + bias
    if not _takes(x, weight):
        return F.linear(x, weight, bias)
    y = _decode_linear_op(x, weight)
    return y if bias is None else y + bias


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
        and heads % kv_heads == 0 and heads // kv_heads <= 8
        and keys.stride(-1) == 1 and values.stride(-1) == 1 and keys.stride(2) == values.stride(2)
        and not (torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad or values.requires_grad))
        and decode_attention_available()
    )


def decode_attention_available() -> bool:
    """Whether the native attention ops (``decode_attention.cpp``) are built and loaded."""
    return decode_linear_available()


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


def _decode_linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return getattr(torch.ops, _OP_NAMESPACE).decode_linear(x, weight)


# ---------------------------------------------------------------------------------------------
# Quantized weights

_FORMAT_OF_KIND = {0: "q4_0", 1: "q4_1", 2: "q8_0"}
# None until the first quantized call: whether quant_linear is the native op or the torch fallback.
_quant_native: bool | None = None


def _define_reference_op() -> None:
    """``quant_linear`` in plain torch, under the native op's name and schema, where the library
    could not be built: compiled steps and eager calls see the same op either way."""
    from genfn.quant.reference import reference_linear

    library = torch.library.Library(_OP_NAMESPACE, "FRAGMENT")
    library.define("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int kind, "
                   "int out_features) -> Tensor")

    def reference(x, codes, scales, mins, kind, out_features):
        weight = QuantizedWeight(codes, scales, mins, _FORMAT_OF_KIND[kind], out_features, codes.shape[1] * 32)
        return reference_linear(x, weight, dtype=torch.float32)

    library.impl("quant_linear", reference, "CPU")
    _define_reference_op.library = library  # the registration lives as long as this object
    _register_quant_fake()


def quant_linear_available() -> bool:
    """Whether quantized linears run the native kernel (else the torch reference, much slower)."""
    global _quant_native
    if _quant_native is None:
        _quant_native = decode_linear_available()
        if not _quant_native:
            _define_reference_op()
    return _quant_native


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x @ weight.dequantize().T`` with ``x`` quantized per block of 32 to 8 bits (see quant_linear.cpp)."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"linear: x has {x.shape[-1]} features, the quantized weight expects {weight.in_features}")
    quant_linear_available()
    return getattr(torch.ops, _OP_NAMESPACE).quant_linear(x, weight.codes, weight.scales, weight.mins,
                                                          weight.kind, weight.out_features)


def kquant_linear(x: torch.Tensor, weight: KQuantWeight) -> torch.Tensor:
    """``x @ weight.dequantize().T`` with ``x`` quantized per 256 inputs to 8 bits (see kquant_linear.cpp)."""
    from genfn.kernels.kquant import kquant_linear as native

    return native(x, weight)


def embedding(tokens: torch.Tensor, table, dtype: torch.dtype) -> torch.Tensor:
    """``F.embedding(tokens, table)`` as ``dtype``; a ``KQuantWeight`` table (a GGUF file's quantized
    embedding, kept as stored) is read row by row: the looked-up rows' blocks gathered and
    dequantized, never the whole table."""
    if isinstance(table, KQuantWeight):
        from genfn.quant.kquants import dequantize_k

        return dequantize_k(table.data[tokens], table.format).to(dtype)
    return F.embedding(tokens, table)
