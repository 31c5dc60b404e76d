"""llama.cpp as a peer in the decode benchmark: GGUF variants of the shipped model, and a greedy
batched decoder over llama-cpp-python's low-level API (the ``bench`` extra).

    python -m genfn.bench.llamacpp make-variants    # writes F32/F16/Q8_0/Q4_0 files made from the Q4_1 one

The variants are made from the shipped Q4_1 file (dequantized, then stored as F32/F16 or
requantized to Q8_0/Q4_0 with the ``gguf`` package's reference quantizers), so every engine
of a format reads the same file. They are written under ``$GENFN_BENCH_DIR`` (default
``~/.cache/genfn/gguf-variants``).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path
from typing import Mapping

import numpy as np

# File types as llama.cpp numbers them (general.file_type), and the ggml type of their matrices.
_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}


def variant_dir() -> Path:
    return Path(os.environ.get("GENFN_BENCH_DIR") or Path.home() / ".cache" / "genfn" / "gguf-variants")


def variant_path(source: str, ggml_type: str, matrix_types: Mapping[str, str] | None = None) -> str:
    """The file holding ``source``'s model with its matrices in ``ggml_type`` (the source itself
    when it already is that type); made on first use. ``matrix_types`` (a GGUF tensor name's part,
    e.g. ``"ffn_down"``, to a type) stores those matrices in their own type (``make_variant``)."""
    stem = Path(source).name.split(".")[0]
    if Path(source).name.endswith(f".{ggml_type}.gguf") and not matrix_types:
        return source
    mix = "".join(f"+{part}-{t}" for part, t in sorted((matrix_types or {}).items()))
    target = variant_dir() / f"{stem}.{ggml_type}{mix}.gguf"
    if not target.exists():
        make_variant(source, str(target), ggml_type, matrix_types)
    return str(target)


def make_variant(source: str, target: str, ggml_type: str, matrix_types: Mapping[str, str] | None = None) -> None:
    """``source`` rewritten with its matrices in ``ggml_type`` (the gguf package's quantizers), and
    those whose name holds a part in ``matrix_types`` (``blk.3.ffn_down.weight``: ``ffn_down``) in
    that part's type (``genfn.bench.gguf_matrices.encode``: K-quants too)."""
    import gguf
    import torch
    from gguf.quants import dequantize, quantize

    from genfn.bench.gguf_matrices import encode

    qtype = gguf.GGMLQuantizationType[ggml_type]
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    partial = target + f".{os.getpid()}.tmp"
    writer = gguf.GGUFWriter(partial, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = _FILE_TYPES[ggml_type]
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        own_type = next((t for part, t in (matrix_types or {}).items() if f".{part}." in tensor.name), None)
        if values.ndim < 2:
            writer.add_tensor(tensor.name, values)  # norms stay float32, as llama.cpp's tools keep them
        elif own_type is not None:
            array, raw = encode(torch.from_numpy(values.reshape(-1, values.shape[-1]).copy()), own_type)
            writer.add_tensor(tensor.name, array, raw_dtype=raw)
        elif tensor.name in ("token_embd.weight", "output.weight") and ggml_type.startswith("Q4"):
            # The shipped file's mix: 4-bit matrices, an 8-bit embedding/output (kept as stored).
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
        elif qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, values)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(tensor.name, values.astype(np.float16))
        else:
            writer.add_tensor(tensor.name, quantize(values, qtype), raw_dtype=qtype)  # shape from the bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, target)


def file_weight_bytes(path: str) -> int:
    """Bytes of a GGUF file's matrices read per decoded token (all but the embedding table when
    an output matrix exists; with a tied head the table is the head and counts once). A mixture of
    experts' stacks (``[E, rows, cols]``) count the ``k`` of ``E`` experts a token's router picks."""
    from genfn.models.loaders.gguf import read_gguf

    gguf = read_gguf(path)
    tensors, arch = gguf.tensors, gguf.metadata.get("general.architecture")
    tied = "output.weight" not in tensors
    matrices = sum(info.nbytes for name, info in tensors.items()
                   if len(info.shape) == 2 and (tied or name != "token_embd.weight"))
    experts, used = gguf.metadata.get(f"{arch}.expert_count"), gguf.metadata.get(f"{arch}.expert_used_count")
    if not experts or not used:
        return matrices
    return matrices + sum(info.nbytes * int(used) // int(experts) for info in tensors.values() if len(info.shape) == 3)


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


_QUIET = None


def _quiet(lc) -> None:
    """Silence llama.cpp's load-time log lines (hundreds of them per model)."""
    global _QUIET
    if _QUIET is None:
        _QUIET = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(_QUIET, ctypes.c_void_p(0))


class LlamaCpp:
    """Greedy decoding of several sequences at once through ``llama_decode`` (one batch a step).
    ``float32_cache``: keys and values kept in float32 (llama.cpp's default is float16), for token
    agreement tests on float weights."""

    def __init__(self, path: str, threads: int, max_sequences: int, max_len: int, float32_cache: bool = False):
        import llama_cpp as lc

        self.lc = lc
        _quiet(lc)
        lc.llama_backend_init()
        params = lc.llama_model_default_params()
        if os.environ.get("GENFN_LLAMA_REPACK", "1") == "0" and hasattr(params, "use_extra_bufts"):
            # llama-bench's --repack 0: no repacked/AMX weight buffers (their AMX path crashed on
            # some VMs during decode).
            params.use_extra_bufts = False
        load = getattr(lc, "llama_model_load_from_file", None) or lc.llama_load_model_from_file
        self.model = load(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        ctx_params = lc.llama_context_default_params()
        ctx_params.n_ctx = max_sequences * max_len
        ctx_params.n_batch = max(512, max_sequences * max_len)
        ctx_params.n_ubatch = 512
        ctx_params.n_seq_max = max_sequences
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        if float32_cache:
            ctx_params.type_k = ctx_params.type_v = 0  # GGML_TYPE_F32
        new_context = getattr(lc, "llama_init_from_model", None) or lc.llama_new_context_with_model
        self.ctx = new_context(self.model, ctx_params)
        vocab = lc.llama_model_get_vocab(self.model) if hasattr(lc, "llama_model_get_vocab") else None
        n_vocab = getattr(lc, "llama_vocab_n_tokens", None)
        self.n_vocab = n_vocab(vocab) if n_vocab is not None and vocab is not None else lc.llama_n_vocab(self.model)
        self.batch = lc.llama_batch_init(ctx_params.n_batch, 0, max_sequences)

    def _clear(self) -> None:
        lc = self.lc
        if hasattr(lc, "llama_memory_clear") and hasattr(lc, "llama_get_memory"):
            lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        elif hasattr(lc, "llama_kv_self_clear"):
            lc.llama_kv_self_clear(self.ctx)
        else:
            lc.llama_kv_cache_clear(self.ctx)

    def _decode(self, entries) -> None:
        """``entries``: (token, position, sequence, wants_logits) for one llama_decode call."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _logits(self, index: int) -> np.ndarray:
        """The vocabulary's logits at batch entry ``index`` of the last decode (llama.cpp's buffer)."""
        ptr = self.lc.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,))

    def generate(self, prompts: list[list[int]], new_tokens: int, logits: list[list[np.ndarray]] | None = None,
                 never: int | None = None) -> list[list[int]]:
        """Greedy continuation of every prompt by ``new_tokens`` tokens (EOS ignored). ``logits``: a
        list that receives, per prompt, a copy of each step's logits (float32 ``[vocab]``);
        ``never``: a token the choice skips (as ``min_new_tokens`` keeps EOS out)."""
        self._clear()
        entries, last = [], []
        for s, ids in enumerate(prompts):
            for p, token in enumerate(ids):
                entries.append((token, p, s, p == len(ids) - 1))
            last.append(len(entries) - 1)
        if logits is not None:
            logits[:] = [[] for _ in prompts]

        def choose(s: int, index: int) -> int:
            row = self._logits(index)
            if logits is not None:
                logits[s].append(row.copy())
            if never is not None:
                row = row.copy()
                row[never] = -np.inf
            return int(row.argmax())

        self._decode(entries)
        out = [[choose(s, i)] for s, i in enumerate(last)]
        for step in range(1, new_tokens):
            self._decode([(out[s][-1], len(ids) + step - 1, s, True) for s, ids in enumerate(prompts)])
            for s in range(len(prompts)):
                out[s].append(choose(s, s))
        return out

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        free_ctx = getattr(self.lc, "llama_free", None)
        if free_ctx is not None:
            free_ctx(self.ctx)
        free_model = getattr(self.lc, "llama_model_free", None) or self.lc.llama_free_model
        free_model(self.model)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["make-variants"]:
        print(__doc__)
        return 0 if {"-h", "--help"} & set(args) else 2
    from genfn.default_model import default_model_path

    for ggml_type in ("F32", "F16", "Q8_0", "Q4_0"):
        t = time.perf_counter()
        path = variant_path(default_model_path(), ggml_type)
        print(f"{ggml_type}: {path} ({os.path.getsize(path) / 1e6:.0f} MB, {time.perf_counter() - t:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
