"""Stop strings, checked inside the step: a tensorized matcher built once per (vocabulary, strings).

A stop string is caught when it overlaps the *newest* token, whatever the token boundaries:
for "stop", the tails ["st", "op"], ["sto", "pper"], ["las", "topper"] all match. Walking the
sequence backwards from the newest token, the newest token must begin with an end piece of the
string (its "end overlap"), and every earlier token must sit exactly where the characters
matched so far leave off (one of its "valid positions", counted from the end of the string,
possibly running off the string's start). Both facts depend only on (token, stop string), so
they are tabulated once per vocabulary; the run-time check is then a few gathers, a cumsum and
comparisons over a fixed window of the token buffer: no strings, no host sync, static shapes.
This is the algorithm of transformers' StopStringCriteria, and it gives the same answers.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from genfn.state.base import pytree_dataclass, static_field
from genfn.inputs import check_tokenizer

__all__ = ["StopStringMatcher", "stop_string_criteria", "stop_string_matching_mode", "stop_string_in_new_tokens",
           "token_bytes", "matching_positions", "build_stop_tables"]

_STATIC_PREFIX = "abcdef"
_TABLE_CACHE: OrderedDict[Any, StopStringMatcher] = OrderedDict()
_TABLE_CACHE_SIZE = 8


def _backend_of(tokenizer: Any):
    """The `tokenizers.Tokenizer` behind genfn's or transformers' tokenizer (None if there is none)."""
    from tokenizers import Tokenizer as Backend

    if isinstance(tokenizer, Backend):
        return tokenizer
    for name in ("backend", "backend_tokenizer", "_tokenizer"):
        candidate = getattr(tokenizer, name, None)
        if isinstance(candidate, Backend):
            return candidate
    return None


def _decoder_types(config: Any) -> set:
    found = set()
    if isinstance(config, dict):
        if isinstance(config.get("type"), str):
            found.add(config["type"])
        for value in config.values():
            found |= _decoder_types(value)
    elif isinstance(config, list):
        for value in config:
            found |= _decoder_types(value)
    return found


def stop_string_matching_mode(tokenizer: Any) -> str | None:
    """How token strings are compared: ``"byte_level"`` (GPT-2 byte alphabet), ``"byte_fallback"``
    (``<0xNN>`` tokens), or ``None`` (plain text). Byte modes compare UTF-8 bytes, so a stop string
    whose characters span several byte tokens is still caught."""
    backend = _backend_of(tokenizer)
    if backend is None:  # a tokenizer-like object whose backend is not a `tokenizers.Tokenizer`
        backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    if type(decoder).__name__ == "ByteLevel":
        return "byte_level"
    state = getattr(decoder, "__getstate__", lambda: None)()
    if isinstance(state, (bytes, bytearray)):
        state = state.decode("utf-8", "replace")
    try:
        config = json.loads(state) if isinstance(state, str) else None
    except json.JSONDecodeError:
        config = None
    types = _decoder_types(config)
    if "ByteFallback" in types:
        return "byte_fallback"
    if "ByteLevel" in types:
        return "byte_level"
    return None


def token_bytes(token: str, mode: str | None, byte_of: dict | None) -> bytes | None:
    """The bytes ``token`` spells in a byte mode: through ``byte_of`` (the GPT-2 byte alphabet,
    character -> byte) in ``"byte_level"``, as ``<0xNN>`` in ``"byte_fallback"``; ``None`` when it
    spells none that way (plain text mode, an added token, a character outside the alphabet)."""
    if mode == "byte_level":
        if byte_of is not None and all(char in byte_of for char in token):
            return bytes(byte_of[char] for char in token)
        return None
    if (mode == "byte_fallback" and len(token) == 6 and token.startswith("<0x") and token.endswith(">")
            and all(c in "0123456789abcdefABCDEF" for c in token[3:5])):
        return bytes([int(token[3:5], 16)])
    return None


def _clean_vocabulary(tokenizer: Any, vocab: dict, mode: str | None) -> list[tuple[Any, int]]:
    """``(text the token yields, id)`` per vocabulary entry: bytes in byte modes, str otherwise.

    A token the byte alphabet cannot spell is rendered by the tokenizer's decoder after a fixed
    prefix (which is then cut off), so decoders that strip or add a leading space do it to the
    prefix, not to the token.
    """
    backend = _backend_of(tokenizer)
    decoder = getattr(backend, "decoder", None)
    byte_of = None
    if mode == "byte_level":
        from genfn.tokenizer import bytes_to_unicode

        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    if backend is not None:
        prefix_tokens = [backend.id_to_token(i) for i in backend.encode(_STATIC_PREFIX, add_special_tokens=False).ids]
    else:
        prefix_tokens = list(_STATIC_PREFIX)

    def render(token: str) -> str:
        if backend is None:  # a plain vocabulary: tokens spell themselves
            return token
        pieces = prefix_tokens + [token]
        text = decoder.decode(pieces) if decoder is not None else " ".join(pieces)
        start = text.find(_STATIC_PREFIX)
        if start < 0:
            raise ValueError(f"stop_strings: the tokenizer's decoder ({type(decoder).__name__}) does not reproduce "
                             f"plain text ({_STATIC_PREFIX!r} came back as {text!r}), so the stop strings cannot be "
                             f"matched against its tokens")
        return text[start + len(_STATIC_PREFIX):]

    out = []
    for token, index in vocab.items():
        text = token_bytes(token, mode, byte_of)
        if text is None:
            text = render(token)
            if mode is not None:
                text = text.encode("utf-8")
        out.append((text, int(index)))
    return out


def _valid_positions(token, stop) -> list[int]:
    """Offsets ``i`` (from the end of ``stop``, ``1 <= i < len(stop)``) where ``token`` can sit
    right before ``i`` already-matched characters; it may run off the start of ``stop``."""
    rev_stop, rev_token = stop[::-1], token[::-1]
    return [i for i in range(1, len(stop)) if rev_token.startswith(rev_stop[i:i + len(token)])]


def _end_overlaps(token, stop) -> list[int]:
    """How many trailing characters of ``stop`` the start of ``token`` can complete (one entry per
    place in ``token`` where such a piece ends)."""
    if not stop:
        return [0] * max(0, len(token) - 1)
    found, last = [], stop[-1:]
    end = token.find(last)
    while end >= 0:
        overlap = min(end + 1, len(stop))
        if token[end + 1 - overlap:end + 1] == stop[len(stop) - overlap:]:
            found.append(overlap)
        end = token.find(last, end + 1)
    return found


def matching_positions(clean: list[tuple[Any, int]], stops: tuple) -> tuple[list[dict], list[dict]]:
    """Per stop string, ``{token id: valid positions}`` and ``{token id: end overlaps}`` (see
    :func:`_valid_positions`, :func:`_end_overlaps`) for the tokens that have any."""
    positions = [{} for _ in stops]
    overlaps = [{} for _ in stops]
    for s, stop in enumerate(stops):
        last = stop[-1:]
        for text, index in clean:
            # A token can sit inside a match only if its last character is in the stop string,
            # and complete one only if it holds the string's last character.
            if not text or text[-1:] in stop:
                p = _valid_positions(text, stop)
                if p:
                    positions[s][index] = p
            if not text or not stop or last in text:
                e = _end_overlaps(text, stop)
                if e:
                    overlaps[s][index] = e
    return positions, overlaps


def build_stop_tables(clean: list[tuple[Any, int]], stops: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    positions, overlaps = matching_positions(clean, stops)
    max_p = max((len(v) for table in positions for v in table.values()), default=1)
    if not any(overlaps):
        raise ValueError(
            "Stop string preprocessing was unable to identify tokens matching one or more of the supplied stop "
            "string(s). This is most often caused by the stop strings containing unusual characters that are "
            "not in the tokenizer vocabulary.")
    max_e = max(len(v) for table in overlaps for v in table.values())
    rows = max(index for _, index in clean) + 2  # the last row is a dummy for out-of-vocabulary ids
    pos_table = np.full((rows, len(stops), max_p), -1, dtype=np.int32)
    end_table = np.full((rows, len(stops), max_e), -1, dtype=np.int32)
    lengths = np.full((rows,), -1, dtype=np.int32)
    for s in range(len(stops)):
        for index, p in positions[s].items():
            pos_table[index, s, :len(p)] = p
        for index, e in overlaps[s].items():
            end_table[index, s, :len(e)] = e
    for text, index in clean:
        lengths[index] = len(text)
    pos_table, end_table, lengths = (torch.from_numpy(t) for t in (pos_table, end_table, lengths))
    return pos_table, end_table, lengths


@pytree_dataclass
class StopStringMatcher:
    """``matcher(tokens [B, N], cur_len [B]) -> [B] bool``: which rows end with a stop string.

    Row ``b``'s sequence is ``tokens[b, :cur_len[b]]`` (a 0-d ``cur_len`` serves every row). Build
    with :meth:`from_tokenizer`. Only the last ``window`` filled columns of each row are read (one
    token per character at most), by gather at ``cur_len[b] - 1 - k``; columns before the row's
    start read a dummy row that matches nothing, and columns past ``cur_len[b]`` are never read.
    Pure and compile-safe.
    """

    positions: torch.Tensor  # [R, S, P] int32: valid positions per (token, stop string), -1 filler
    end_lengths: torch.Tensor  # [R, S, E] int32: end overlaps per (token, stop string), -1 filler
    lengths: torch.Tensor  # [R] int32: characters (bytes) per token; -1 for the dummy row
    target_lengths: torch.Tensor  # [S] int32
    stop_strings: tuple = static_field(())
    window: int = static_field(1)
    digest: str = static_field("")  # content hash of the tables: a hashable identity for compile keys

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, stop_strings: str | Sequence[str], device: Any = None) -> StopStringMatcher:
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        stop_strings = tuple(stop_strings)
        if not stop_strings or not all(isinstance(s, str) for s in stop_strings):
            raise ValueError(f"`stop_strings` must be a string or a non-empty list of strings, got {stop_strings!r}")
        check_tokenizer(tokenizer, "stop_strings", ("get_vocab",))
        mode = stop_string_matching_mode(tokenizer)
        stops = stop_strings if mode is None else tuple(s.encode("utf-8") for s in stop_strings)
        vocab = tokenizer.get_vocab()
        cache_key = (tuple(sorted(vocab.items())), stops, mode)
        matcher = _TABLE_CACHE.get(cache_key)
        if matcher is None:
            clean = _clean_vocabulary(tokenizer, vocab, mode)
            pos_table, end_table, lengths = build_stop_tables(clean, stops)
            digest = hashlib.sha1()
            for t in (pos_table, end_table, lengths):
                digest.update(t.numpy().tobytes())
            matcher = cls(pos_table, end_table, lengths,
                          torch.tensor([len(s) for s in stops], dtype=torch.int32),
                          stop_strings, max(len(s) for s in stops), digest.hexdigest())
            _TABLE_CACHE[cache_key] = matcher
            while len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
                _TABLE_CACHE.popitem(last=False)
        else:
            _TABLE_CACHE.move_to_end(cache_key)
        if device is not None:
            matcher = matcher.to(device)
        return matcher

    def to(self, device: Any) -> StopStringMatcher:
        return self.replace(positions=self.positions.to(device), end_lengths=self.end_lengths.to(device),
                            lengths=self.lengths.to(device), target_lengths=self.target_lengths.to(device))

    @property
    def key(self) -> tuple:
        """A hashable identity (equal tables, equal key)."""
        return (self.stop_strings, self.digest)

    def __call__(self, tokens: torch.Tensor, cur_len: torch.Tensor) -> torch.Tensor:
        batch, n = tokens.shape
        rows = self.lengths.shape[0]
        # Newest first: column cur_len[b] - 1 - k for k < window; columns before 0 read the dummy row.
        offsets = torch.arange(self.window, device=tokens.device)
        cols = (cur_len.to(tokens.device).reshape(-1, 1) - 1 - offsets).expand(batch, self.window)
        ids = tokens.gather(1, cols.clamp(min=0, max=n - 1))
        ids = torch.where(cols >= 0, ids.clamp(min=0, max=rows - 1), rows - 1)
        end = self.end_lengths[ids[:, 0]]  # [B, S, E]
        earlier = ids[:, 1:]
        positions = self.positions[earlier]  # [B, W-1, S, P]
        lengths = self.lengths[earlier]  # [B, W-1]
        # Characters matched after each token, one track per possible end overlap: [B, W, S, E].
        steps = torch.cat([end.unsqueeze(1), lengths[:, :, None, None].expand(-1, -1, *end.shape[1:])], dim=1)
        matched = steps.cumsum(dim=1)
        first = end > 0
        # Token k continues a track if the characters matched before it is one of its positions.
        later = (matched[:, :-1, :, :, None] == positions[:, :, :, None, :]).any(dim=-1)
        ok = torch.cat([first.unsqueeze(1), later], dim=1)
        alive = ok.int().cumprod(dim=1).bool()  # a track dies at its first mismatch
        best = torch.where(alive, matched, torch.zeros_like(matched)).amax(dim=(1, 3))  # [B, S]
        return (best >= self.target_lengths).any(dim=-1)


def stop_string_in_new_tokens(matcher: StopStringMatcher, tokens: torch.Tensor, old_len: torch.Tensor,
                              cur_len: torch.Tensor, max_new: int) -> torch.Tensor:
    """``[B]`` True where a stop string ends at one of the tokens the latest step appended
    (columns ``old_len[b] <= c < cur_len[b]``, at most ``max_new`` of them: a static bound).

    For steps that append several tokens (speculation): the row's text is checked as it stood
    after each new token, so a stop string completed before the last one is caught too.
    """
    found = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    for back in range(max_new):
        end = cur_len - back
        found = found | (matcher(tokens, end) & (end > old_len))
    return found


def stop_string_criteria(tokenizer: Any, stop_strings: Any, device: Any = None) -> StopStringMatcher:
    """The matcher ``generate(stop_strings=..., tokenizer=...)`` builds (raises like transformers
    when there is no tokenizer)."""
    if tokenizer is None:
        raise ValueError(
            "There are one or more stop strings, either in the arguments to `generate` or in the model's generation "
            "config, but we could not locate a tokenizer. When generating with stop strings, you must pass the "
            "model's tokenizer to the `tokenizer` argument of `generate`.")
    return StopStringMatcher.from_tokenizer(tokenizer, stop_strings, device)
