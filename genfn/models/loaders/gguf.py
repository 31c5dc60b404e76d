"""Load a GGUF file (llama.cpp's format): metadata -> HF-style config, tensors -> dequantized
state dict under Hugging Face names, tokenizer metadata -> genfn Tokenizer.

The file is parsed here with a small reader rather than `gguf.GGUFReader`: the latter builds a
numpy view per element of every metadata array and needs ~5 s for a 49k-token vocabulary, which
would be paid on every CLI start. The `gguf` package still supplies the type tables and the
dequantization kernels (`gguf.quants.dequantize`), so every quantization it knows is supported.

llama.cpp's converter permutes the rows of the Q and K projections of llama-family models (to
turn Hugging Face's "rotate half" RoPE layout into GPT-J's interleaved layout); we undo it.
Qwen2, Qwen3, OLMo 2 and Phi-3 files are converted without that permutation (llama.cpp runs them
with NeoX RoPE); SmolLM3's are permuted as Llama's.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import warnings
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from genfn.quant.blocks import GGUF_FORMATS, RowBlocks, from_gguf_bytes
from genfn.quant.fuse import cat_rows
from genfn.quant.experts import fuse_expert_rows
from genfn.quant.kquants import GGUF_K_FORMATS, KQuantWeight
from genfn.models.weight_arena import whole_pages

from . import LoadedCheckpoint, gguf_gpt_oss
from .checks import check_gguf_tensors
from .errors import CheckpointError, check_dtype, check_state_dict
from .gguf_blocks import mapped, place_blocks, place_dequantized
from .gguf_rope import longrope_scaling, rope_scaling_from_metadata

__all__ = ["load_gguf_checkpoint", "read_gguf", "GGUFFile", "GGUFTensorInfo", "SUPPORTED_ARCHITECTURES"]

# GGUF general.architecture -> (HF architecture class, HF model_type, undo Q/K permutation)
SUPPORTED_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3", True),
    "olmo2": ("Olmo2ForCausalLM", "olmo2", False),
    "phi3": ("Phi3ForCausalLM", "phi3", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
    "olmoe": ("OlmoeForCausalLM", "olmoe", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss", False),
}
# Whether llama.cpp renormalizes the chosen experts' weights, where the file does not say
# (``{arch}.expert_weights_norm``): Mixtral (a llama file with experts) and Qwen3-MoE do, OLMoE not.
_EXPERT_WEIGHTS_NORM = {"llama": True, "qwen3moe": True, "olmoe": False, "gpt-oss": False}
# llama.cpp's converter stores Gemma's norm weights plus one (Gemma multiplies by 1 + w).
_NORM_SHIFTED = frozenset({"gemma2", "gemma3"})
# llama.cpp runs SmolLM3 with every fourth layer unrotated and writes no key for it.
_SMOLLM3_NO_ROPE_INTERVAL = 4

# ---------------------------------------------------------------------------------------------
# Reading the file


class GGUFTensorInfo:
    """One tensor's entry: name, numpy-order shape (outermost first), ggml type, absolute offset."""

    __slots__ = ("name", "shape", "ggml_type", "offset", "nbytes")

    def __init__(self, name: str, shape: tuple[int, ...], ggml_type: int, offset: int, nbytes: int):
        self.name, self.shape, self.ggml_type, self.offset, self.nbytes = name, shape, ggml_type, offset, nbytes


class GGUFFile:
    """A parsed GGUF file: `metadata` (key -> Python value) and `tensors` (name -> info).

    `tensor(name)` returns the dequantized float32 numpy array (a fresh copy); `tensor(name, cut)`
    only a slice of it, reading only the slice's bytes."""

    def __init__(self, path: str, buffer: mmap.mmap, metadata: dict[str, Any], tensors: dict[str, GGUFTensorInfo]):
        self.path, self._buffer, self.metadata, self.tensors = path, buffer, metadata, tensors

    def raw(self, name: str, cut: tuple[int, int, int] | None = None) -> np.ndarray:
        """The tensor's bytes ``[*shape[:-1], row bytes]``, a view of the file mapping; ``cut = (dim,
        start, stop)``: only rows (``dim=0`` of a matrix, ``dim=1`` of an expert stack ``[E, rows,
        cols]``) or last-dimension values ``[start, stop)`` (whole blocks), still a view: nothing
        outside the slice is read."""
        info = self.tensors[name]
        data = np.frombuffer(self._buffer, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        data = data.reshape(_byte_shape(info.shape, info.ggml_type))
        if cut is None:
            return data
        dim, start, stop = cut
        if dim != len(info.shape) - 1:  # rows, or each expert's rows of a stack [E, rows, cols]
            return data[(slice(None),) * dim + (slice(start, stop),)]
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        if start % block or stop % block:
            raise CheckpointError(
                f"{self.path}: tensor {name} is stored in {GGMLQuantizationType(info.ggml_type).name} blocks of "
                f"{block} values; a slice of values [{start}, {stop}) would cut a block (pick a --tp that splits "
                "the layer into whole blocks)")
        return data[..., start // block * size: stop // block * size]

    def raw_run(self, names: list[str]) -> np.ndarray | None:
        """The bytes of matrices ``names`` of one row width that lie back to back in the file, as one
        view of the mapping ``[their rows, row bytes]``; None where they do not."""
        infos = [self.tensors[name] for name in names]
        if any(a.offset + a.nbytes != b.offset for a, b in zip(infos, infos[1:])):
            return None
        widths = {_byte_shape(info.shape, info.ggml_type)[-1] for info in infos}
        if len(widths) != 1 or any(len(info.shape) != 2 for info in infos):
            return None
        data = np.frombuffer(self._buffer, dtype=np.uint8, count=sum(i.nbytes for i in infos), offset=infos[0].offset)
        return data.reshape(-1, widths.pop())

    def release(self, name: str) -> None:
        """Let go of the tensor's pages of the file mapping once its bytes are copied elsewhere: they
        leave this process's resident memory (the page cache keeps them; a later read maps them again)."""
        info = self.tensors[name]
        start, stop = whole_pages(info.offset, info.offset + info.nbytes)
        if stop > start and hasattr(mmap, "MADV_DONTNEED"):
            self._buffer.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def shape(self, name: str, cut: tuple[int, int, int] | None = None) -> tuple[int, ...]:
        """The tensor's numpy-order shape, or its slice's (see ``raw``)."""
        shape = self.tensors[name].shape
        if cut is None:
            return shape
        dim, start, stop = cut
        return (*shape[:dim], stop - start, *shape[dim + 1:])

    def tensor(self, name: str, cut: tuple[int, int, int] | None = None) -> np.ndarray:
        info = self.tensors[name]
        raw, shape = np.ascontiguousarray(self.raw(name, cut)), self.shape(name, cut)
        plain = _PLAIN_TYPES.get(info.ggml_type)
        if plain is not None:  # astype copies: the result must not alias the read-only file mapping
            return raw.view(plain).astype(np.float32).reshape(shape)
        try:
            out = dequantize(raw, GGMLQuantizationType(info.ggml_type))
        except NotImplementedError:
            raise CheckpointError(
                f"{self.path}: tensor {name} uses ggml type {GGMLQuantizationType(info.ggml_type).name}, "
                "which the installed gguf package cannot dequantize"
            ) from None
        return np.asarray(out, dtype=np.float32).reshape(shape)


_PLAIN_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}

# GGUF metadata value types: id -> struct format (8 = string, 9 = array, handled apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count


def _byte_shape(shape: tuple[int, ...], ggml_type: int) -> tuple[int, ...]:
    """The uint8 shape of a tensor's data: each row of `shape[-1]` values is stored as blocks."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if shape[-1] % block:
        raise CheckpointError(f"row of {shape[-1]} values is not a multiple of the block size {block}")
    return (*shape[:-1], shape[-1] // block * size)


class _Cursor:
    """Sequential little-endian reads from a buffer; running off the end means a truncated file."""

    def __init__(self, buffer: mmap.mmap):
        self.buffer, self.pos = buffer, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buffer):
            raise struct.error("string runs past the end of the file")
        raw = self.buffer[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("I"), self.unpack("Q")
            if item_kind in _SCALARS:  # read numeric arrays in one go
                fmt = "<%d%s" % (count, _SCALARS[item_kind])
                values = list(struct.unpack_from(fmt, self.buffer, self.pos))
                self.pos += struct.calcsize(fmt)
                return values
            if item_kind == _STRING:
                return self.strings(count)
            return [self.value(item_kind) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {kind}")

    def strings(self, count: int) -> list[str]:
        """``count`` strings one after another: ``string``'s steps without its calls per string (a
        49k-token vocabulary and its merges: 0.16-0.23 s where ``string`` took 0.38-0.44 s)."""
        buffer, pos, end, length = self.buffer, self.pos, len(self.buffer), _LENGTH.unpack_from
        out = []
        for _ in range(count):
            (n,) = length(buffer, pos)
            pos += 8
            if pos + n > end:
                raise struct.error("string runs past the end of the file")
            out.append(buffer[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out


def read_gguf(path: str) -> GGUFFile:
    """Parse the header, metadata and tensor table of a GGUF (v2/v3, little-endian) file."""
    try:
        with open(path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError:  # mmap of an empty file
        raise CheckpointError(f"{path}: not a GGUF file (empty)") from None
    try:
        cur = _Cursor(buffer)
        if buffer[:4] != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (bad magic {bytes(buffer[:4])!r})")
        cur.pos = 4
        version = cur.unpack("I")
        if version not in (2, 3):
            raise CheckpointError(f"{path}: unsupported GGUF version {version} (big-endian or too old/new)")
        n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("I"))
        entries = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.unpack("Q") for _ in range(cur.unpack("I"))]
            entries.append((name, tuple(reversed(dims)), cur.unpack("I"), cur.unpack("Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
        tensors = {}
        for name, shape, ggml_type, offset in entries:
            try:
                GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError):
                raise CheckpointError(f"{path}: tensor {name} has unknown ggml type {ggml_type}") from None
            try:
                nbytes = int(np.prod(_byte_shape(shape or (1,), ggml_type)))
            except CheckpointError as e:
                raise CheckpointError(f"{path}: tensor {name}: {e}") from None
            start = data_start + offset
            if start + nbytes > len(buffer):
                raise CheckpointError(f"{path}: truncated GGUF file (tensor {name} runs past the end of the file)")
            tensors[name] = GGUFTensorInfo(name, shape or (1,), ggml_type, start, nbytes)
    except CheckpointError:
        raise
    except (struct.error, ValueError, OverflowError, MemoryError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated GGUF file ({e})") from None
    return GGUFFile(path, buffer, metadata, tensors)


# ---------------------------------------------------------------------------------------------
# Config


def _config_from_metadata(gguf: GGUFFile) -> dict[str, Any]:
    """An HF-style config dict (see LoadedCheckpoint) from the `{arch}.*` metadata keys."""
    md, path = gguf.metadata, gguf.path
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))} (a model transformers can load runs through "
            "genfn.from_module(module))"
        )
    hf_arch, model_type, _ = SUPPORTED_ARCHITECTURES[arch]

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = md.get(f"{arch}.{key}", default)
        if value is None and required:
            raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = get("embedding_length", required=True)
    heads = get("attention.head_count", required=True)
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts; a uniform list is fine
        if len(set(kv_heads)) != 1:
            raise CheckpointError(f"{path}: per-layer attention.head_count_kv is not supported")
        kv_heads = kv_heads[0]
    head_dim = get("attention.key_length") or (get("rope.dimension_count") if arch == "llama" else None)
    tokens = md.get("tokenizer.ggml.tokens")
    vocab_size = get("vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None and "token_embd.weight" in gguf.tensors:
        vocab_size = gguf.tensors["token_embd.weight"].shape[0]
    rope_theta = float(get("rope.freq_base", 10000.0))
    rope_scaling = rope_scaling_from_metadata(md, arch) if arch != "phi3" else longrope_scaling(gguf, arch)
    head_dim = head_dim or hidden // heads

    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length", required=True),
        "num_hidden_layers": get("block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": {"rope_theta": rope_theta, **(rope_scaling or {"rope_type": "default"})},
        "max_position_embeddings": get("context_length"),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "mlp_bias": False,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
        "_name_or_path": md.get("general.name"),
    }
    experts = get("expert_count")
    if experts:
        if arch not in _EXPERT_WEIGHTS_NORM:
            raise CheckpointError(f"{path}: GGUF architecture {arch!r} with experts is not supported")
        if arch == "llama":
            config.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                          sliding_window=get("attention.sliding_window"))
        config.update(num_experts=int(experts), num_experts_per_tok=int(get("expert_used_count", required=True)),
                      norm_topk_prob=bool(get("expert_weights_norm", _EXPERT_WEIGHTS_NORM[arch])),
                      moe_intermediate_size=int(get("expert_feed_forward_length") or config["intermediate_size"]))
        if arch == "llama":  # Mixtral's experts are its MLP: their size is intermediate_size
            config["intermediate_size"] = config["moe_intermediate_size"]
    if arch in _NORM_SHIFTED:
        config.update(_gemma_fields(gguf, arch, head_dim, hidden // heads))
    if arch == gguf_gpt_oss.ARCH:
        config.update(gguf_gpt_oss.config_fields(md, config))
    if arch == "smollm3":
        config["no_rope_layer_interval"] = int(get("no_rope_layer_interval", _SMOLLM3_NO_ROPE_INTERVAL))
    if arch == "phi3":
        rotary = get("rope.dimension_count")
        if rotary is not None and int(rotary) != head_dim:
            config["partial_rotary_factor"] = int(rotary) / head_dim
        config["sliding_window"] = get("attention.sliding_window")
        if rope_scaling is not None:
            config["original_max_position_embeddings"] = rope_scaling["original_max_position_embeddings"]
    return config


def _gemma_fields(gguf: GGUFFile, arch: str, head_dim: int, hidden_per_head: int) -> dict[str, Any]:
    """Gemma's settings; llama.cpp fixes the layer pattern (every 2nd / 6th layer global), Gemma 3's
    local RoPE base (10000) and the attention scale (head_dim, hidden_size / heads for the 27B
    models) rather than storing them."""
    md = gguf.metadata
    layers = int(md[f"{arch}.block_count"])
    pattern = 2 if arch == "gemma2" else 6
    big = layers == (46 if arch == "gemma2" else 62)  # the 27B models
    fields = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": md.get(f"{arch}.attention.sliding_window"),
        "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)],
        "query_pre_attn_scalar": hidden_per_head if big else head_dim,
        "attn_logit_softcapping": md.get(f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": md.get(f"{arch}.final_logit_softcapping"),
    }
    if arch == "gemma3":
        fields["rope_local_base_freq"] = 10000.0
    return fields


# ---------------------------------------------------------------------------------------------
# Tensors

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",
    # One stacked [E, rows, cols] tensor per projection; gate and up are fused after reading.
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Where an architecture names a block tensor otherwise (Phi-3's ffn_up holds gate and up, fused).
_ARCH_BLOCK_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"},
                     "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
                     "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
                     gguf_gpt_oss.ARCH: gguf_gpt_oss.BLOCK_NAMES}
# Present in some files but not model parameters: llama.cpp's precomputed RoPE tables (Phi-3's
# LongRoPE factors are read into the config).
_IGNORED = re.compile(r"^(rope_freqs\.weight|rope_factors_(long|short)\.weight|blk\.\d+\.attn_rot_embd\.weight)$")
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face parameter name for a GGUF tensor name of architecture ``arch``, or None if it has none."""
    if m := _BLOCK.match(gguf_name):
        layer, part, kind = m.groups()
        names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
        return f"model.layers.{layer}.{names[part]}.{kind}" if part in names else None
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[stem]}.{kind}" if stem in _GLOBAL_NAMES else None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows: per head, rows were reordered from
    [first half, second half] to interleaved pairs; put them back."""
    rows = w.shape[0]
    head_dim = rows // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tensor(gguf: GGUFFile, name: str, keep_blocks: bool, dtype: torch.dtype,
            pieces: tuple[tuple[int, int, int], ...] | None = None) -> torch.Tensor | RowBlocks:
    """A tensor's float values, or (``keep_blocks``, a matrix in a format genfn's kernels run) its
    blocks as stored; ``pieces``: only those slices of it (see ``GGUFFile.raw``), one after the
    other (rows of a fused matrix's parts)."""
    if pieces is not None and len(pieces) > 1:
        return cat_rows([_tensor(gguf, name, keep_blocks, dtype, (piece,)) for piece in pieces])
    cut = None if pieces is None else pieces[0]
    info = gguf.tensors[name]
    type_name = GGMLQuantizationType(info.ggml_type).name
    shape = gguf.shape(name, cut)
    # A mixture of experts' stacked projection [E, rows, cols] is kept as its E * rows rows of
    # blocks (no block crosses a row); _stacked_experts splits them per expert again.
    matrix = (int(np.prod(shape[:-1])), shape[-1])
    if keep_blocks and type_name in GGUF_FORMATS and len(shape) in (2, 3):
        return from_gguf_bytes(gguf.raw(name, cut), type_name, matrix)
    if keep_blocks and type_name in GGUF_K_FORMATS and len(shape) in (2, 3):
        # A row slice is still one run of the mapping's bytes (no copy); a column slice is copied.
        return KQuantWeight.from_bytes(mapped(np.ascontiguousarray(gguf.raw(name, cut))), GGUF_K_FORMATS[type_name],
                                       matrix)
    return torch.from_numpy(gguf.tensor(name, cut)).to(dtype)


def _state_dict(gguf: GGUFFile, config: dict[str, Any], permuted: bool, dtype: torch.dtype,
                keep_blocks: bool = False, plan=None, arena=None) -> dict[str, torch.Tensor | RowBlocks]:
    """The state dict under Hugging Face names; ``plan(hf_name) -> pieces | None``: read only those
    slices ``(dim, start, stop)`` of each tensor it names (a tensor-parallel rank's); ``arena`` (no
    plan): write the kept matrices (or Q8_0/Q4_0/Q4_1 values) straight into it (``gguf_blocks``)."""
    state_dict: dict[str, torch.Tensor | RowBlocks] = {}
    unknown = []
    arch = gguf.metadata["general.architecture"]

    def qk_heads(name: str, hf_name: str) -> int | None:
        """The heads a Q/K projection's rows were permuted over (a slice's own count), or None."""
        heads = None
        if permuted and ".self_attn.q_proj." in hf_name:
            heads = config["num_attention_heads"]
        elif permuted and ".self_attn.k_proj." in hf_name:
            heads = config["num_key_value_heads"]
        pieces = None if plan is None else plan(hf_name)  # a permuted q/k projection's: one piece
        cut = pieces[0] if pieces else None
        return None if heads is None else heads * gguf.shape(name, cut)[0] // gguf.tensors[name].shape[0]

    def row_order(name: str) -> np.ndarray | None:
        hf_name = hf_tensor_name(name, arch)
        heads = None if hf_name is None else qk_heads(name, hf_name)
        return None if heads is None else unpermute_qk(torch.arange(gguf.tensors[name].shape[0]), heads).numpy()

    placed = {} if plan is not None or arena is None else (
        place_blocks(gguf, row_order, arena) if keep_blocks else place_dequantized(gguf, row_order, arena, dtype))
    for name in gguf.tensors:
        hf_name = hf_tensor_name(name, arch)
        if hf_name is None:
            if name == "rope_freqs.weight":
                warnings.warn(
                    f"{gguf.path}: ignoring rope_freqs.weight (llama.cpp's per-frequency RoPE factors, e.g. "
                    "Llama 3.1 scaling); genfn uses the rope settings of the config instead",
                    stacklevel=3,
                )
            elif not _IGNORED.match(name):
                unknown.append(name)
            continue
        if name in placed:  # already unpermuted
            state_dict[hf_name] = placed.pop(name)
            continue
        keep = keep_blocks and (arch != gguf_gpt_oss.ARCH or gguf_gpt_oss.keeps_blocks(name))
        t = _tensor(gguf, name, keep, dtype, None if plan is None else plan(hf_name))
        if arch in _NORM_SHIFTED and name.endswith("norm.weight"):
            t = (t.float() - 1.0).to(dtype)
        heads = qk_heads(name, hf_name)
        if heads is not None:
            # The permutation moves whole rows, so quantized rows move with their blocks intact.
            t = (t.map_rows(lambda a: unpermute_qk(a, heads)) if isinstance(t, (RowBlocks, KQuantWeight))
                 else unpermute_qk(t, heads))
        state_dict[hf_name] = t
    if unknown:
        raise CheckpointError(
            f"{gguf.path}: GGUF holds tensors genfn cannot map to a {config['architectures'][0]}: "
            + ", ".join(unknown[:8])
        )
    if arch == gguf_gpt_oss.ARCH:
        return gguf_gpt_oss.transformers_layout(state_dict, gguf.path)
    return _stacked_experts(state_dict, gguf.path, config.get("num_experts"))


def _shapes(gguf: GGUFFile, num_experts: int | None) -> dict[str, torch.Tensor]:
    """The state dict's names with shape-only stand-ins (meta tensors) for its tensors."""
    arch = gguf.metadata["general.architecture"]
    names = {name: hf_tensor_name(name, arch) for name in gguf.tensors}
    return _stacked_experts({hf: torch.empty(gguf.tensors[name].shape, device="meta")
                             for name, hf in names.items() if hf is not None}, gguf.path, num_experts)


def _stacked_experts(state_dict: dict[str, Any], path: str, num_experts: int | None) -> dict[str, Any]:
    """llama.cpp's per-projection expert stacks as transformers 5 names them: gate and up fused
    along each expert's rows (``experts.gate_up_proj [E, 2I, H]``), ``experts.down_proj [E, H, I]``.
    Blocks kept (``keep_blocks``) become ``genfn.quant.QuantizedExperts``, each expert's blocks as
    stored (gate and up in different formats are dequantized to be fused)."""
    for name in [n for n in state_dict if n.endswith(".mlp.experts.gate_proj.weight")]:
        stem = name[: -len("gate_proj.weight")]
        up = state_dict.pop(stem + "up_proj.weight", None)
        down = state_dict.pop(stem + "down_proj.weight", None)
        if up is None or down is None or not num_experts:
            raise CheckpointError(f"{path}: {stem} has gate experts but no up or down experts (or no expert_count)")
        state_dict[stem + "gate_up_proj"] = fuse_expert_rows([state_dict.pop(name), up], num_experts)
        state_dict[stem + "down_proj"] = fuse_expert_rows([down], num_experts)
    return state_dict


# ---------------------------------------------------------------------------------------------


def load_gguf_checkpoint(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                         keep_blocks: bool = False, shard_plan=None, arena=None) -> LoadedCheckpoint:
    """Load a GGUF file: dequantize every tensor to `dtype` under HF names (see module docstring).

    `keep_blocks=True` keeps Q8_0/Q4_0/Q4_1 matrices as they are stored (`genfn.quant.RowBlocks`,
    rows unpermuted like the float ones) and Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS ones as `genfn.quant.KQuantWeight`
    over the file's mapped bytes, instead of dequantizing them; a mixture of experts' stacked
    projections in those formats become `genfn.quant.QuantizedExperts`.

    `shard_plan(config) -> plan`, with `plan(hf_name) -> pieces | None`: read only those slices
    `(dim, start, stop)` of each tensor the plan names (a tensor-parallel rank's,
    `genfn.models.tensor_parallel.slice_plan`); the whole tensors' shapes are checked first.

    `arena` (a `genfn.models.weight_arena.WeightArena`, no plan): the kept matrices (without
    `keep_blocks`: the Q8_0/Q4_0/Q4_1 ones' `dtype` values, bit for bit numpy's) are written once,
    straight from the file mapping into it, tiles already in the kernel's layout, a layer's fused
    parts back to back (see `gguf_blocks`); the file's pages are let go as they are read."""
    check_dtype(dtype)
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file does not exist: {path}")
    gguf = read_gguf(path)
    config = _config_from_metadata(gguf)
    permuted = SUPPORTED_ARCHITECTURES[gguf.metadata["general.architecture"]][2]
    plan = None
    if shard_plan is not None:
        shapes = _shapes(gguf, config.get("num_experts"))  # the whole tensors, as shapes only, checked before any slice is read
        check_state_dict(shapes, config, path)
        check_gguf_tensors(gguf, shapes, config)
        plan = shard_plan(config)
    state_dict = _state_dict(gguf, config, permuted, dtype, keep_blocks, plan, arena)
    if plan is None:
        check_state_dict(state_dict, config, path)
        check_gguf_tensors(gguf, state_dict, config)

    generation_config = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None
    } or None
    tokenizer = None
    if gguf.metadata.get("tokenizer.ggml.tokens"):
        from ...tokenizer.core import Tokenizer

        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata, source=path)
    return LoadedCheckpoint(config, state_dict, generation_config, tokenizer, path)
