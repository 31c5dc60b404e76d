"""Validation of what a caller hands ``generate``: prompts, masks, special token ids, lengths and
buffer sizes.

Everything here runs once, on the host, before the first step (so a host sync is fine), and turns
bad input into a ``ValueError``/``TypeError`` that names the argument and what it may hold,
instead of an index error or a hang deep inside a compiled step.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "as_input_ids",
    "check_token_range",
    "check_special_tokens",
    "eos_token_ids",
    "resolve_pad_token_id",
    "attention_mask_for",
    "check_left_padding",
    "check_prompt_fits",
    "warn_beyond_context",
    "available_memory",
    "check_allocation",
    "kv_cache_nbytes",
    "check_generation_memory",
    "check_logits_shape",
    "check_model",
    "check_tokenizer",
]

logger = logging.getLogger(__name__)


# ---- prompts -----------------------------------------------------------------------------------

def as_input_ids(input_ids: Any, name: str = "input_ids") -> torch.Tensor:
    """``[B, L]`` int64 token ids from a tensor, a numpy array, a list of ids or a list of rows."""
    if input_ids is None:
        raise ValueError(f"{name} is required: a [batch, length] tensor of token ids (or a list of ids)")
    if isinstance(input_ids, (list, tuple)):
        input_ids = _ids_from_lists(input_ids, name)
    elif not isinstance(input_ids, torch.Tensor) and type(input_ids).__module__ == "numpy":
        input_ids = torch.from_numpy(input_ids) if hasattr(input_ids, "dtype") else torch.tensor(input_ids)
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or a list of token ids, got {type(input_ids).__name__}")
    dtype = input_ids.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {dtype}")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2:
        raise ValueError(f"{name} must be [batch, length] (or one [length] prompt), got shape {list(input_ids.shape)}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {list(input_ids.shape)}): the prompt needs at least one token")
    return input_ids.to(torch.int64)


def _ids_from_lists(rows: Sequence, name: str) -> torch.Tensor:
    if len(rows) == 0:
        raise ValueError(f"{name} is empty: the prompt needs at least one token")
    if not any(isinstance(t, (list, tuple)) for t in rows):  # one prompt, a flat list of ids
        rows = [list(rows)]
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)):
            raise TypeError(f"{name} must be a list of ints or a list of rows of ints; item {i} is "
                            f"{type(row).__name__} {row!r}"[:300])
        bad = [t for t in row if not _is_int(t)][:1]
        if bad:
            bad = bad[0]
            raise TypeError(f"{name} must hold integer token ids; row {i} holds {type(bad).__name__} {bad!r}")
    lengths = sorted({len(row) for row in rows})
    if len(lengths) != 1:
        raise ValueError(f"{name} rows have different lengths ({lengths}); pad them on the left and pass "
                         f"attention_mask")
    return torch.tensor([list(row) for row in rows], dtype=torch.int64)


def _is_int(value: Any) -> bool:
    # bool is an int subclass, and a float 3.0 is not a token id.
    return isinstance(value, int) and not isinstance(value, bool)


def check_token_range(ids: torch.Tensor, vocab_size: int, name: str = "input_ids") -> None:
    """Every id in ``ids`` must index the vocabulary ``[0, vocab_size)``."""
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab_size}): min {low}, max {high}")


# ---- special tokens ----------------------------------------------------------------------------

_SPECIAL_TOKENS = ("pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id")


def eos_token_ids(value: Any) -> tuple[int, ...]:
    """``eos_token_id`` (None, an id, a list of ids or a tensor) as a tuple of ids; a negative id
    means none (transformers' ``eos_token_id=-1``: never stop early), so it is dropped. The one EOS
    normaliser: ``generate``, continuous batching, the server and the CLI read EOS ids through it."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"eos_token_id must hold integer token ids, got a tensor of dtype {value.dtype}")
        return tuple(int(v) for v in value.reshape(-1).tolist() if v >= 0)
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if not _is_int(v):
            raise TypeError(f"eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(int(v) for v in values if v >= 0)


def check_special_tokens(config: Any, vocab_size: int) -> None:
    """pad / eos / bos / decoder_start ids of ``config`` (any object with those attributes), when
    set, must be ids of the vocabulary: finished rows emit the pad id and the model embeds it."""
    for name in _SPECIAL_TOKENS:
        value = getattr(config, name, None)
        if value is None:
            continue
        if name == "eos_token_id":
            ids = eos_token_ids(value)
        elif name == "decoder_start_token_id" and isinstance(value, (list, tuple)) and all(map(_is_int, value)):
            ids = tuple(value)  # one start token per batch row
        elif isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
            ids = (int(value),)
        elif _is_int(value):
            ids = (value,)
        else:
            raise TypeError(f"{name} must be an int token id, got {type(value).__name__} {value!r}")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"{name}={value!r} is outside the vocabulary: token ids must be in [0, {vocab_size})")


def resolve_pad_token_id(pad_token_id: int | None, eos_ids: tuple[int, ...]) -> int:
    """The id finished rows emit: ``pad_token_id``, else the first eos id (as transformers does),
    else 0 (nothing can finish early then, so it is never emitted)."""
    if pad_token_id is not None:
        return int(pad_token_id)
    return eos_ids[0] if eos_ids else 0


# ---- attention mask ----------------------------------------------------------------------------

def attention_mask_for(input_ids: torch.Tensor, attention_mask: Any, pad_token_id: int | None,
                       eos_ids: tuple[int, ...]) -> torch.Tensor:
    """The ``[B, L]`` int64 0/1 mask of ``input_ids``: the given one, checked, or one inferred.

    Like transformers, padding is inferred only when ``pad_token_id`` is set, occurs in the
    prompt and is not an eos id; an inferred mask must pass the same checks as a given one.
    """
    if attention_mask is None:
        inferable = pad_token_id is not None and pad_token_id not in eos_ids
        if inferable and bool((input_ids == pad_token_id).any()):
            mask = (input_ids != pad_token_id).long()
            check_left_padding(mask, f"the attention mask inferred from pad_token_id={pad_token_id}")
            return mask
        if input_ids.shape[0] > 1 and not inferable:
            logger.warning(
                "The attention mask and the pad token id were not set, with a batched input. As a consequence, you "
                "may observe unexpected behavior. Please pass your input's `attention_mask` to obtain reliable results.")
        return torch.ones_like(input_ids)
    if isinstance(attention_mask, (list, tuple)):
        attention_mask = torch.tensor(attention_mask)
    elif not isinstance(attention_mask, torch.Tensor) and type(attention_mask).__module__ == "numpy":
        attention_mask = torch.as_tensor(attention_mask)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor (or numpy array) of 0/1, got "
                        f"{type(attention_mask).__name__}")
    if attention_mask.dtype.is_complex:
        raise ValueError(f"attention_mask must have an integer, bool or float dtype (values 0/1), got "
                         f"{attention_mask.dtype}")
    if attention_mask.dtype.is_floating_point:
        # transformers accepts a float mask of 0.0/1.0 (tokenizers return one when asked for floats).
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            values = sorted(set(torch.unique(attention_mask).tolist()) - {0.0, 1.0})[:5]
            raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (token), got other values {values}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {list(attention_mask.shape)} must equal input_ids shape "
                         f"{list(input_ids.shape)}")
    mask = attention_mask.to(device=input_ids.device, dtype=torch.int64)
    if not bool(((mask == 0) | (mask == 1)).all()):
        values = sorted(set(torch.unique(mask).tolist()) - {0, 1})[:5]
        raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (token), got other values {values}")
    check_left_padding(mask, "attention_mask")
    return mask


def check_left_padding(mask: torch.Tensor, what: str) -> None:
    """Each row must be zeros (padding) then ones, with at least one one."""
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"{what}: row(s) {empty[:8]} are all padding; every prompt needs at least one real token")
    not_left = (mask[:, 1:] < mask[:, :-1]).any(-1).nonzero().flatten().tolist()
    if not_left:
        raise ValueError(f"{what}: row(s) {not_left[:8]} have padding after a real token (right padding); genfn, like "
                         f"transformers for decoder-only models, needs left padding (tokenizer padding_side='left')")


# ---- models and tokenizers --------------------------------------------------------------------

def check_model(model: Any, name: str = "model") -> None:
    """``model`` must be a genfn model (``genfn.load``, ``genfn.from_module``, ``genfn.Model``): a
    value with ``apply``, ``init_cache``, ``vocab_size`` and ``generation_config``."""
    if model is None or isinstance(model, (str, os.PathLike)):
        hint = (f"; load it first: genfn.load({str(model)!r})" if isinstance(model, (str, os.PathLike))
                else "")
        raise TypeError(f"{name} must be a genfn model (genfn.load(path), genfn.from_module(nn_module)), got "
                        f"{type(model).__name__} {model!r}{hint}"[:400])
    if isinstance(model, torch.nn.Module) and not hasattr(model, "init_cache"):
        raise TypeError(f"{name} is a torch.nn.Module ({type(model).__name__}); wrap it first: "
                        f"genfn.from_module(module)")
    missing = [attr for attr in ("apply", "init_cache", "vocab_size", "generation_config") if not hasattr(model, attr)]
    if missing:
        raise TypeError(f"{name} must be a genfn model (genfn.load(path), genfn.from_module(nn_module)); "
                        f"{type(model).__name__} has no {', '.join(missing)}")
    vocab = getattr(model, "vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise TypeError(f"{name}.vocab_size must be an int >= 1, got {vocab!r}")


def check_tokenizer(tokenizer: Any, purpose: str, methods: Sequence[str]) -> None:
    """``tokenizer`` must offer ``methods`` (callables) for ``purpose`` (``stop_strings``,
    ``token_healing``), and its ``get_vocab()`` must map token strings to int ids."""
    missing = [m for m in methods if not callable(getattr(tokenizer, m, None))]
    if missing:
        raise TypeError(f"{purpose} needs a tokenizer (genfn's, or a transformers tokenizer) with "
                        f"{', '.join(m + '()' for m in methods)}; {type(tokenizer).__name__} has no "
                        f"{', '.join(m + '()' for m in missing)}")
    if "get_vocab" in methods:
        vocab = tokenizer.get_vocab()
        if not isinstance(vocab, dict) or not vocab or not all(
                isinstance(t, str) and _is_int(i) for t, i in vocab.items()):
            raise TypeError(f"{purpose}: tokenizer.get_vocab() must return a non-empty dict of token string -> int "
                            f"id, got {type(vocab).__name__}"
                            + (f" with an entry {next(iter(vocab.items()))!r}" if isinstance(vocab, dict) and vocab
                               else ""))


# ---- the model's output -----------------------------------------------------------------------

def check_logits_shape(logits: torch.Tensor, rows: int, vocab_size: int, tokenizer_size: int | None = None) -> None:
    """The prefill's logits ``[rows, ..., V]`` must have one row per prompt row and one column per
    vocabulary entry: a model whose head is narrower than its vocabulary (or than its tokenizer)
    would otherwise decode from the wrong columns without complaint. Checked once per call, on the
    prefill (every later step runs the same model on the same shapes)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        raise ValueError(f"the model must return logits [batch, ..., vocab]; got "
                         f"{type(logits).__name__} {list(getattr(logits, 'shape', []))}")
    if logits.shape[0] != rows:
        raise ValueError(f"the model returned logits for {logits.shape[0]} rows, but the batch has {rows} rows "
                         f"(logits shape {list(logits.shape)}); its apply must keep the batch dimension")
    if logits.shape[-1] != vocab_size:
        raise ValueError(f"the model returned logits with {logits.shape[-1]} columns, but its vocabulary "
                         f"(vocab_size) has {vocab_size} entries; the output head and the config disagree")
    if tokenizer_size is not None and tokenizer_size > logits.shape[-1]:
        # Not an error: transformers runs such pairs (tokens added without resizing the embeddings),
        # and they decode correctly until the prompt holds one of the extra ids (check_token_range).
        logger.warning("the tokenizer has %d tokens, more than the model's %d logits columns: the model can never "
                       "produce the last %d; check that the tokenizer belongs to this model", tokenizer_size,
                       logits.shape[-1], tokenizer_size - logits.shape[-1])


# ---- lengths and memory ------------------------------------------------------------------------

def check_prompt_fits(prompt_len: int, max_position_embeddings: int | None) -> None:
    """A prompt must fit the model's context; generating past it only warns (:func:`warn_beyond_context`)."""
    if max_position_embeddings is not None and prompt_len >= max_position_embeddings:
        raise ValueError(f"the prompt has {prompt_len} tokens but the model's context (max_position_embeddings) "
                         f"is {max_position_embeddings}")


def warn_beyond_context(length: int, max_position_embeddings: int | None) -> None:
    """Log transformers' reminder, once, when a sequence runs past the model's context."""
    if max_position_embeddings is not None and length > max_position_embeddings:
        _remind_context(int(max_position_embeddings))


@functools.lru_cache(maxsize=None)
def _remind_context(max_position_embeddings: int) -> None:
    logger.warning(
        "This is a friendly reminder - the current text generation call has exceeded the model's predefined "
        f"maximum length ({max_position_embeddings}). Depending on the model, you may observe exceptions, "
        "performance degradation, or nothing at all.")


def available_memory(device: torch.device | str | None = None) -> int | None:
    """Bytes that can still be allocated on ``device`` (default: host memory), or None if unknown.

    Host: psutil's available memory when psutil is installed, else the physical memory size.
    CUDA: the free memory the driver reports.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_allocation(nbytes: int, what: str, device: torch.device | str | None = None) -> None:
    """Raise ``ValueError`` naming ``what`` and its size when ``nbytes`` cannot fit in memory.

    Asks the system how much is free instead of allocating to find out (a failed huge allocation
    can take the machine into swap or the OOM killer first).
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a byte count >= 0, got {nbytes!r}")
    free = available_memory(device)
    if free is not None and nbytes > free:
        where = "GPU" if torch.device(device or "cpu").type == "cuda" else "host"
        raise ValueError(f"{what} needs {nbytes:,} bytes ({_human(nbytes)}), more than the {free:,} bytes "
                         f"({_human(free)}) of {where} memory available")


def kv_cache_nbytes(model: Any, batch_size: int, max_cache_len: int) -> int | None:
    """Bytes of a float KV cache for ``batch_size`` rows of ``max_cache_len`` slots (None when the
    model's spec does not say how many layers, kv heads and head dims it has)."""
    spec = getattr(model, "spec", None)
    sizes = [getattr(spec, name, None) for name in ("num_layers", "num_kv_heads", "head_dim")]
    if any(not isinstance(v, int) for v in sizes):
        return None
    layers, kv_heads, head_dim = sizes
    itemsize = torch.empty((), dtype=getattr(model, "dtype", torch.float32)).element_size()
    return 2 * layers * batch_size * kv_heads * max_cache_len * head_dim * itemsize


def check_generation_memory(model: Any, batch_size: int, max_cache_len: int,
                            cache_implementation: str | None = None) -> None:
    """Refuse a generation whose static buffers (KV cache, token buffer) cannot fit, before
    allocating them: a huge ``max_new_tokens`` is an error message, not an out-of-memory kill."""
    if cache_implementation is not None and cache_implementation.startswith(("offloaded", "quantized")):
        return  # those caches live elsewhere or are smaller than a float cache: no simple bound
    cache = kv_cache_nbytes(model, batch_size, max_cache_len)
    tokens = 8 * batch_size * max_cache_len
    what = (f"the KV cache and token buffer for {batch_size} row(s) x {max_cache_len} positions (max_cache_len; "
            f"lower max_new_tokens or the batch size)")
    check_allocation(tokens + (cache or 0), what, getattr(model, "device", None))


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} PiB"
