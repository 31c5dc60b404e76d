"""Universal assisted generation: an assistant with a different tokenizer drafts through text.

transformers' ``AssistedCandidateGeneratorDifferentTokenizers`` semantics, at any batch size (one
host pass per row). Every round:

1. **target -> assistant** (host): the row's tokens are decoded to text and encoded with the
   assistant's tokenizer. After the first round only a window is re-encoded, the target's tokens from
   ``target_lookbehind`` before the previous round's length on; the window's assistant ids are
   aligned with the tail of the previous round's assistant ids by their longest common run, the
   differing tail is replaced and what is new is appended;
2. **draft** (the assistant's own forwards, greedy on its raw logits): the assistant keeps one static cache per row,
   rewound to the longest prefix it shares with the new assistant ids, so a round feeds only what
   changed and then drafts up to ``num_assistant_tokens``;
3. **assistant -> target** (host): the assistant's ids from ``assistant_lookbehind`` before the
   drafts on are decoded and encoded with the target's tokenizer, aligned with the target's tail the
   same way, and the target tokens after the alignment are the row's drafts (at most the block width);
4. **verify** (pure): the speculative step of :mod:`genfn.strategies.assisted.step`, unchanged, with a
   drafter that hands over the drafts placed in its state; greedy verification keeps the target's
   own greedy tokens, whatever the assistant drafted.

Steps 1-3 go through text, so they run on the host between target verifications: a strategy built
here runs eagerly (``compiles=False``), and only step 4 is a pure step. Drafts carry no
distribution (the assistant's vocabulary is not the target's), so they are verified by matching,
which keeps plain greedy's tokens, and with ``do_sample=True`` plain sampling's tokens for the same
key (transformers instead maps the two vocabularies to sample speculatively; genfn does not).

Two refinements of transformers' rules. (a) Before the longest-run search, genfn tries the alignment
the window's construction implies: it also re-encodes the window's part that the other side already
holds; when that re-encoding is a prefix of the whole window's and (but for its first token, which a
word boundary may change) ends the other side's ids, the tokens after it are the new ones. Otherwise
(a tokenization that changed at the boundary, say) the longest-run search decides, as in
transformers. The search alone misplaces the boundary in repetitive text (a run of one repeated
token matches at several offsets), which offers drafts one or more tokens off, all rejected. (b)
transformers' assistant-side window starts at ``len(ids) - assistant_lookbehind``, which turns
negative (a slice from the end) while the assistant's ids are shorter than the window; genfn starts
it at 0 then.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from genfn.state.base import pytree_dataclass
from genfn.strategies.assisted import step as speculative
from genfn.strategies.assisted.drafter import Draft, DraftInput
from genfn.strategies.assisted.verify import Verified
from genfn.strategies.base import Strategy
from genfn.strategies.request import GenerationRequest

__all__ = ["PendingDraft", "PendingDrafter", "UniversalSession", "universal_strategy", "longest_common_run",
           "align_new_tokens", "continuation", "convert_through_text"]


# -- the pure half: a drafter whose drafts were placed in its state on the host -----------------


@pytree_dataclass
class PendingDraft:
    tokens: torch.Tensor  # [B, k] int64: target-token drafts placed by the host step
    num_valid: torch.Tensor  # [B] int64


@dataclasses.dataclass(frozen=True)
class PendingDrafter:
    """A :class:`~genfn.strategies.assisted.step.ModelDrafter` that proposes the drafts in its state."""

    num_tokens: int

    @property
    def gives_logits(self) -> bool:
        return False

    def prefill(self, model, request: GenerationRequest) -> PendingDraft:
        batch, device = request.batch_size, request.input_ids.device
        return PendingDraft(tokens=torch.zeros(batch, self.num_tokens, dtype=torch.int64, device=device),
                            num_valid=torch.zeros(batch, dtype=torch.int64, device=device))

    def draft(self, model, state: PendingDraft, view: DraftInput, cache) -> tuple[Draft, PendingDraft, Any]:
        return Draft(tokens=state.tokens, num_valid=torch.minimum(state.num_valid, view.budget)), state, cache

    def commit(self, state: PendingDraft, verified: Verified, view: DraftInput) -> PendingDraft:
        return state


# -- the host half: re-encoding through text ---------------------------------------------------


def _decode(tokenizer, ids: list[int]) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=True)
    except TypeError:  # genfn's and `tokenizers`' decode take no clean_up_tokenization_spaces
        return tokenizer.decode(ids, skip_special_tokens=True)


def _encode(tokenizer, text: str) -> list[int]:
    encoded = tokenizer.encode(text, add_special_tokens=True)
    return list(getattr(encoded, "ids", encoded))


def convert_through_text(ids: list[int], source, destination) -> list[int]:
    """``ids`` of ``source``'s vocabulary as ``destination``'s: decoded (special tokens skipped), re-encoded."""
    return _encode(destination, _decode(source, ids))


def longest_common_run(old: list[int], new: list[int]) -> tuple[int, int, int] | None:
    """``(i, j, length)``: the longest run ``new[i:i + length] == old[j:j + length]`` (the first in
    ``new``-major order among equals, as transformers' diagonal search), or None when no token is shared."""
    best = None
    for i in range(len(new)):
        for j in range(len(old)):
            if new[i] != old[j] or (i > 0 and j > 0 and new[i - 1] == old[j - 1]):
                continue  # not a match, or inside a run that started earlier
            length = 1
            while i + length < len(new) and j + length < len(old) and new[i + length] == old[j + length]:
                length += 1
            if best is None or length > best[2]:
                best = (i, j, length)
    return best


def continuation(old: list[int], known: list[int], new: list[int]) -> list[int] | None:
    """The tokens ``new`` adds after ``old``, when ``new`` re-encodes ``known`` (the text ``old`` ends
    with) plus more: ``known`` must begin ``new`` and, but for its first token, end ``old``. None when
    the re-encodings disagree (the caller then searches the longest common run)."""
    if len(known) < 2 or new[:len(known)] != known or old[len(old) - (len(known) - 1):] != known[1:]:
        return None
    return new[len(known):]


def align_new_tokens(old: list[int], new: list[int]):
    """How ``new`` (a re-encoding of ``old``'s tail plus more) continues ``old``: ``(replace, fix, extra)``,
    where the last ``replace`` tokens of ``old`` differ from ``new``'s reading of them, ``fix`` is that
    reading (possibly shorter) and ``extra`` the tokens past ``old``'s end; None when they share nothing."""
    run = longest_common_run(old, new)
    if run is None:
        return None
    i, j, length = run
    start = i + length
    replace = len(old) - (j + length)
    return replace, new[start:start + replace], new[start + replace:]


@dataclasses.dataclass
class _Row:
    """One row's assistant-side memory across rounds (host objects)."""

    assistant_ids: list[int] | None = None  # the previous round's assistant sequence, drafts included
    assistant_input: list[int] | None = None  # the previous round's assistant input, without its drafts
    target_len: int = 0  # the target length the previous round started from
    cache: Any = None  # the assistant's [1, ...] static cache
    cached: list[int] = dataclasses.field(default_factory=list)  # the ids whose keys/values it holds


class UniversalSession:
    """The host state of one ``generate`` call: each row's assistant ids, cache and windows."""

    def __init__(self, assistant, target_tokenizer, assistant_tokenizer, *, num_tokens: int,
                 num_assistant_tokens: int, target_lookbehind: int, assistant_lookbehind: int, batch_size: int,
                 target_vocab_size: int):
        self.assistant, self.target_vocab_size = assistant, target_vocab_size
        self.target_tokenizer, self.assistant_tokenizer = target_tokenizer, assistant_tokenizer
        self.num_tokens, self.num_assistant_tokens = num_tokens, num_assistant_tokens
        self.target_lookbehind, self.assistant_lookbehind = target_lookbehind, assistant_lookbehind
        self.rows = [_Row() for _ in range(batch_size)]
        eos = assistant.generation_config.eos_token_id if assistant.generation_config is not None else None
        self.assistant_eos = set([eos] if isinstance(eos, int) else (eos or []))

    # 1. target -> assistant
    def _assistant_input(self, row: _Row, target_ids: list[int]) -> list[int]:
        to_assistant = (self.target_tokenizer, self.assistant_tokenizer)
        if row.assistant_ids is None or row.target_len <= self.target_lookbehind:
            return convert_through_text(target_ids, *to_assistant)
        start = row.target_len - self.target_lookbehind
        window = convert_through_text(target_ids[start:], *to_assistant)
        known = convert_through_text(target_ids[start:row.target_len], *to_assistant)
        extra = continuation(row.assistant_input, known, window)
        if extra is not None:
            return row.assistant_input + extra
        previous = list(row.assistant_ids)
        aligned = align_new_tokens(previous[-len(window):] if window else [], window)
        if aligned is None:
            return previous + window
        replace, fix, extra = aligned
        if replace > 0 and fix:
            previous = previous[:len(previous) - replace] + fix
        return previous + extra

    # 2. the assistant's greedy drafts, feeding only what its cache lacks
    def _draft(self, row: _Row, ids: list[int], count: int) -> list[int]:
        shared = 0
        for a, b in zip(row.cached, ids):
            if a != b:
                break
            shared += 1
        shared = min(shared, len(ids) - 1)  # feed at least the newest token: its logits choose the first draft
        needed = len(ids) + count
        if row.cache is None or row.cache.max_cache_len < needed:
            row.cache = self.assistant.init_cache(1, max(64, 2 * needed), "static")
            shared = 0
        device = row.cache.length.device
        cache = row.cache.rewind(torch.tensor([shared], device=device))
        fed = torch.tensor([ids[shared:]], dtype=torch.int64, device=device)
        positions = torch.arange(shared, len(ids), device=device).unsqueeze(0)
        drafts: list[int] = []
        with torch.no_grad():
            logits, cache = self.assistant.apply(fed, positions, cache)
            for i in range(count):
                token = int(logits[0, -1].argmax())
                if token in self.assistant_eos:
                    break
                drafts.append(token)
                if i + 1 == count:
                    break
                logits, cache = self.assistant.apply(torch.tensor([[token]], device=device),
                                                     torch.tensor([[len(ids) + i]], device=device), cache)
        row.cache, row.cached = cache, ids + drafts[:-1] if drafts else list(ids)
        return drafts

    # 3. assistant -> target
    def _target_drafts(self, target_ids: list[int], assistant_ids: list[int], sequence: list[int]) -> list[int]:
        start = max(0, len(assistant_ids) - self.assistant_lookbehind)
        to_target = (self.assistant_tokenizer, self.target_tokenizer)
        window = convert_through_text(sequence[start:], *to_target)
        extra = continuation(target_ids, convert_through_text(sequence[start:len(assistant_ids)], *to_target), window)
        if extra is not None:
            return extra
        aligned = align_new_tokens(target_ids[-len(window):] if window else [], window)
        if aligned is None:
            return window
        return aligned[2]

    def propose(self, state: "speculative.SpeculativeState") -> "speculative.SpeculativeState":
        """The host step: every unfinished row's drafts, placed in the state for the pure step to verify."""
        k = self.num_tokens
        budget = speculative.row_budget(state, k).tolist()
        lengths, starts = state.cur_len.tolist(), state.first_column.tolist()
        tokens = state.tokens
        rows_tokens = [tokens[b, starts[b]:lengths[b]].tolist() if budget[b] > 0 else None
                       for b in range(tokens.shape[0])]
        drafted = torch.zeros(tokens.shape[0], k, dtype=torch.int64)
        valid = torch.zeros(tokens.shape[0], dtype=torch.int64)
        for b, target_ids in enumerate(rows_tokens):
            if target_ids is None:
                continue
            row = self.rows[b]
            assistant_ids = self._assistant_input(row, target_ids)
            # The row's budget (schedule, max_length) in target tokens bounds the assistant's work too.
            drafts = self._draft(row, assistant_ids, max(1, min(self.num_assistant_tokens, budget[b])))
            row.assistant_ids, row.assistant_input, row.target_len = assistant_ids + drafts, assistant_ids, len(target_ids)
            if not drafts:
                continue
            new = self._target_drafts(target_ids, assistant_ids, assistant_ids + drafts)[:k]
            # An id the target's tokenizer has but its model lacks (added tokens) ends the drafts.
            usable = next((i for i, t in enumerate(new) if not 0 <= t < self.target_vocab_size), len(new))
            drafted[b, :usable] = torch.tensor(new[:usable], dtype=torch.int64)
            valid[b] = usable
        device = tokens.device
        pending = PendingDraft(tokens=drafted.to(device), num_valid=valid.to(device))
        return state.replace(drafter_state=pending)


def _check_tokenizer(tokenizer, name: str) -> None:
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise TypeError(f"{name} must be a tokenizer with encode(text) and decode(ids) (a transformers, genfn or "
                        f"`tokenizers` tokenizer), got {type(tokenizer).__name__}")


def universal_strategy(assistant, target_tokenizer, assistant_tokenizer, request: GenerationRequest, *,
                       schedule=None, on_finish=None) -> Strategy:
    """The eager :class:`~genfn.strategies.base.Strategy` drafting with ``assistant`` through text.

    ``num_assistant_tokens`` (default 20) is both the assistant's drafts per round and the target
    block's width; ``assistant_lookbehind`` / ``target_lookbehind`` (default 10 / 10) size the
    re-encoded windows.
    """
    _check_tokenizer(target_tokenizer, "tokenizer")
    _check_tokenizer(assistant_tokenizer, "assistant_tokenizer")
    for name in ("apply", "init_cache", "vocab_size"):
        if not hasattr(assistant, name):
            raise TypeError(f"assistant_model must be a genfn Model (load it with genfn.load or wrap it with "
                            f"genfn.from_module), got {type(assistant).__name__}")
    config = request.config
    num_tokens = int(config.num_assistant_tokens or 20)
    windows = {name: int(value if value is not None else 10)
               for name, value in (("target_lookbehind", config.target_lookbehind),
                                   ("assistant_lookbehind", config.assistant_lookbehind))}
    drafter = PendingDrafter(num_tokens=num_tokens)
    inner = speculative.speculative_strategy(drafter, schedule=schedule, on_finish=on_finish, name="universal_assisted")
    sessions: dict[str, UniversalSession] = {}

    def init(model, request: GenerationRequest):
        sessions["current"] = UniversalSession(assistant, target_tokenizer, assistant_tokenizer,
                                               num_tokens=num_tokens, num_assistant_tokens=num_tokens,
                                               batch_size=request.batch_size, target_vocab_size=model.vocab_size,
                                               **windows)
        return inner.init(model, request)

    def step(model, state):
        # Host (text), then the pure verification: this step is not compiled.
        state = sessions["current"].propose(state)
        return inner.step(model, state)

    return dataclasses.replace(inner, init=init, step=step, compiles=False)
