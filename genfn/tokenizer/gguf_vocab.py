"""GGUF vocabularies: a `tokenizers` backend from the ``tokenizer.*`` metadata a GGUF file carries.

llama.cpp stores a model's tokenizer as metadata next to its tensors: the tokens, their types,
merges or scores, the pre-tokenizer's name and the special token ids. This module reads that
metadata (and only that: it stops before the tensor table) and rebuilds the tokenizer from it, so
that ``genfn.tokenizer`` needs nothing from the model loaders (which build their tokenizer with it).
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

__all__ = ["bytes_to_unicode", "gguf_tokenizer_parts", "read_gguf_metadata"]


# ---- the metadata section of a GGUF file --------------------------------------------------------

# GGUF metadata value types: id -> struct format (8 = string, 9 = array, handled apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The key -> value metadata of a GGUF (v2/v3, little-endian) file; its tensors are not touched.

    Raises ValueError naming the file when it is not a GGUF file or is cut short.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError(f"{path}: not a GGUF file (empty)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            try:
                return _parse_metadata(buffer, path)
            except (struct.error, OverflowError, MemoryError) as e:
                raise ValueError(f"{path}: corrupt or truncated GGUF file ({e})") from None


def _parse_metadata(buffer: mmap.mmap, path: str) -> dict[str, Any]:
    if buffer[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (bad magic {bytes(buffer[:4])!r})")
    (version,) = struct.unpack_from("<I", buffer, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version} (big-endian or too old/new)")
    _n_tensors, n_kv = struct.unpack_from("<QQ", buffer, 8)
    pos, metadata = 24, {}
    for _ in range(n_kv):
        key, pos = _string(buffer, pos)
        (kind,) = struct.unpack_from("<I", buffer, pos)
        metadata[key], pos = _value(buffer, pos + 4, kind)
    return metadata


def _string(buffer: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buffer, pos)
    start = pos + 8
    if start + n > len(buffer):
        raise struct.error("string runs past the end of the file")
    return buffer[start : start + n].decode("utf-8", errors="replace"), start + n


def _value(buffer: mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, buffer, pos)[0], pos + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(buffer, pos)
    if kind == _ARRAY:
        item_kind, count = struct.unpack_from("<IQ", buffer, pos)
        pos += 12
        if item_kind in _SCALARS:  # numeric arrays in one go
            fmt = "<%d%s" % (count, _SCALARS[item_kind])
            return list(struct.unpack_from(fmt, buffer, pos)), pos + struct.calcsize(fmt)
        items = []
        for _ in range(count):
            item, pos = _value(buffer, pos, item_kind)
            items.append(item)
        return items, pos
    raise struct.error(f"unknown metadata value type {kind}")


# ---- the tokenizer they describe ----------------------------------------------------------------


def gguf_tokenizer_parts(metadata: Mapping[str, Any], source: str | None = None) -> tuple[Backend, dict[str, Any]]:
    """The backend and the Tokenizer keyword arguments (special tokens, chat template, BOS/EOS flags)
    that a GGUF file's ``tokenizer.*`` metadata describes.

    ``tokenizer.ggml.model`` "gpt2" is byte-level BPE (vocab + merges); "llama" is a
    sentencepiece-style BPE with byte fallback (merges derived from the scores when the file has
    none). Tokens typed CONTROL become special tokens, USER_DEFINED plain added tokens.
    """
    kind = metadata.get("tokenizer.ggml.model")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or ()]
    if kind == "gpt2":
        backend, vocab = _byte_level_backend(tokens, merges, metadata.get("tokenizer.ggml.pre"))
        default_add_bos = False
    elif kind == "llama":
        backend, vocab = _sentencepiece_backend(tokens, metadata, merges)
        default_add_bos = True
    else:
        raise ValueError(
            f"{source or 'GGUF'}: tokenizer model {kind!r} is not supported; supported: gpt2, llama"
        )
    _add_gguf_tokens(backend, tokens, types, vocab, byte_level=kind == "gpt2")

    def named(key: str) -> str | None:
        idx = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    return backend, dict(
        bos_token=named("bos_token_id"),
        eos_token=named("eos_token_id"),
        unk_token=named("unknown_token_id"),
        pad_token=named("padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        add_bos_token=metadata.get("tokenizer.ggml.add_bos_token", default_add_bos),
        add_eos_token=metadata.get("tokenizer.ggml.add_eos_token", False),
    )


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies:
    printable Latin-1 bytes map to themselves, the other 68 bytes to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


# Split regexes for the llama.cpp `tokenizer.ggml.pre` names whose tokenizer.json splits text
# with a custom regex (they follow the models' own tokenizer.json files).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _PRE_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre == "smollm":  # SmolLM's tokenizer.json: every digit on its own, then GPT-2 splitting
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _byte_level_backend(
    tokens: list[str], merges: list[tuple[str, ...]], pre: str | None
) -> tuple[Backend, dict[str, int]]:
    """Byte-level BPE (GPT-2 style). A token written with characters outside the byte alphabet
    (a literal space, say) is respelled in it, as the BPE model looks tokens up by that spelling."""
    alphabet = set(bytes_to_unicode().values())
    spell = bytes_to_unicode()
    vocab = {
        (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)
    }
    backend = Backend(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _sentencepiece_backend(
    tokens: list[str], metadata: Mapping[str, Any], merges: list[tuple[str, ...]]
) -> tuple[Backend, dict[str, int]]:
    """llama.cpp's "llama" vocabulary: sentencepiece BPE with `▁` for spaces and `<0xNN>` byte
    fallback tokens, merges derived from the token scores when the file has none."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if not merges:
        merges = _merges_from_scores(tokens, metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens), vocab)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = Backend(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None))
    prefix_space = metadata.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend, vocab


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Recover BPE merges from a scored vocabulary: every way to split a token into two tokens
    is a merge, ranked by the merged token's score (best first), then by shorter pieces."""
    candidates = []
    for token, score in zip(tokens, scores):
        splits = sorted(
            ((token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab),
            key=lambda pair: (vocab[pair[0]], vocab[pair[1]]),
        )
        candidates.extend((-score, -len(left), -len(right), left, right) for left, right in splits)
    candidates.sort(key=lambda c: c[:3])  # stable: ties keep vocabulary order
    return [(c[3], c[4]) for c in candidates]


def _add_gguf_tokens(
    backend: Backend, tokens: list[str], types: list[int], vocab: dict[str, int], byte_level: bool
) -> None:
    """Make CONTROL tokens (type 3) special and USER_DEFINED ones (type 4) whole added tokens,
    so that text containing them is not split into pieces. In a byte-level vocabulary a
    CONTROL token spelled outside the byte alphabet is a mislabeled ordinary token: skipped."""
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control = [t for t, k in zip(tokens, types) if k == 3 and (alphabet is None or set(t) <= alphabet)]
    if control:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, k in zip(tokens, types) if k == 4 and t in vocab]
    if user:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
