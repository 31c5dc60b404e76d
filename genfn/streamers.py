"""Streamers: receive tokens as ``generate`` produces them (``put``), then ``end``.

They live in the imperative shell: the driver calls them between steps, never inside one. A
streamer decodes with genfn's tokenizer (its incremental decoder: a character split across
tokens prints whole) or with a transformers tokenizer (its ``decode``, with transformers'
print-ready rule: text is released at word ends, newlines and CJK characters), so code written
for transformers' streamers works unchanged.

Whatever way generation exits, the driver ends the stream: ``end()`` after success (calling it
twice is harmless), ``fail(exc)`` after an error, which makes an iterating consumer raise
:class:`GenerationError` instead of waiting forever. :func:`close_stream` does the right one for
any streamer, transformers' included.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import unicodedata
from typing import Any, TextIO

import torch

__all__ = ["BaseStreamer", "TextStreamer", "TextIteratorStreamer", "AsyncTextIteratorStreamer", "GenerationError",
           "close_stream"]


class GenerationError(RuntimeError):
    """Raised to a stream's consumer when the generation feeding it failed (the cause is chained)."""


class BaseStreamer:
    def put(self, value: torch.Tensor) -> None:
        """Receive the prompt (first call, ``[B, P]``) or the newest tokens (``[B]`` or ``[B, k]``)."""

    def end(self) -> None:
        """Generation finished."""

    def fail(self, error: BaseException) -> None:
        """Generation stopped with ``error``; by default the stream just ends."""
        self.end()


def close_stream(streamer: Any, error: BaseException | None = None) -> None:
    """End ``streamer`` after generation, successful (``error`` None) or not.

    genfn's streamers get ``fail(error)``; others (transformers' own) only know ``end()``, which
    at least releases a consumer that iterates over them.
    """
    if streamer is None:
        return
    if error is not None and callable(getattr(streamer, "fail", None)):
        streamer.fail(error)
    else:
        streamer.end()


def _token_ids(value: Any) -> list[int]:
    """The ids of one ``put``: a ``[1, k]``, ``[k]`` or 0-d integer tensor (``k`` may be 0)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"streamer.put expects a torch.Tensor of token ids, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"streamer.put expects integer token ids, got dtype {value.dtype}")
    if value.dim() > 2:
        raise TypeError(f"streamer.put expects [batch, tokens] or [tokens], got shape {list(value.shape)}")
    if value.dim() == 2:
        if value.shape[0] > 1:
            raise ValueError("TextStreamer only supports batch size 1")
        value = value[0]
    return value.reshape(-1).tolist()


# ---- decoding --------------------------------------------------------------------------------

class _IncrementalText:
    """Printable text from genfn's tokenizer, through its incremental decoder."""

    def __init__(self, tokenizer: Any, decode_kwargs: dict):
        unknown = sorted(set(decode_kwargs) - {"skip_special_tokens"})
        if unknown:
            raise TypeError(f"genfn's Tokenizer decodes with skip_special_tokens only; got {', '.join(unknown)}")
        self._decoder = tokenizer.incremental_decoder(**decode_kwargs)

    def prime(self, ids: list[int]) -> None:
        # The prompt is context: the first new token decodes with its leading space right.
        self._decoder.push(ids)

    def push(self, ids: list[int]) -> str:
        return self._decoder.push(ids)

    def flush(self) -> str:
        return self._decoder.flush()


class _PrintReadyText:
    """Printable text from any ``decode(ids, **kwargs) -> str`` (a transformers tokenizer), by
    transformers' rule: decode the pending tokens whole, release text up to the last word end."""

    def __init__(self, tokenizer: Any, decode_kwargs: dict):
        self._decode = lambda ids: tokenizer.decode(ids, **decode_kwargs)
        self._pending: list[int] = []
        self._printed = 0

    def prime(self, ids: list[int]) -> None:
        pass  # as transformers: the skipped prompt is dropped, not used as context

    def push(self, ids: list[int]) -> str:
        self._pending.extend(ids)
        text = self._decode(self._pending)
        if not isinstance(text, str):
            raise TypeError(f"tokenizer.decode must return str, got {type(text).__name__}")
        tail = text[self._printed:]
        if text.endswith("\n"):
            # A finished line: start over from its last token, so old text is never decoded again.
            self._pending = self._pending[-1:]
            self._printed = len(self._decode(self._pending))
            return tail
        if (text and _is_cjk(ord(text[-1]))) or all(c.isspace() or unicodedata.category(c)[0] in "LMN"
                                                     for c in tail):
            ready = tail
        else:  # hold back a word that may still grow (or a character still incomplete)
            ready = text[self._printed:text.rfind(" ") + 1]
        self._printed += len(ready)
        return ready

    def flush(self) -> str:
        tail = self._decode(self._pending)[self._printed:] if self._pending else ""
        self._pending, self._printed = [], 0
        return tail


# CJK ideograph blocks: each such character is a word of its own, printable at once.
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
               (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _is_cjk(codepoint: int) -> bool:
    return any(low <= codepoint <= high for low, high in _CJK_RANGES)


def _text_source(tokenizer: Any, decode_kwargs: dict):
    if callable(getattr(tokenizer, "incremental_decoder", None)):
        return _IncrementalText(tokenizer, decode_kwargs)
    if callable(getattr(tokenizer, "decode", None)):
        return _PrintReadyText(tokenizer, decode_kwargs)
    raise TypeError(f"tokenizer must be a genfn Tokenizer or a transformers tokenizer (anything with decode), got "
                    f"{type(tokenizer).__name__}")


# ---- streamers -------------------------------------------------------------------------------

class TextStreamer(BaseStreamer):
    """Writes decoded text to ``stream`` (stdout) as soon as it is complete; batch size 1 only.

    ``skip_prompt``: do not echo the prompt. Other keyword arguments (``skip_special_tokens``,
    ...) go to the tokenizer's decode, as in transformers.
    """

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, *, stream: TextIO | None = None,
                 **decode_kwargs: Any):
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.decode_kwargs = decode_kwargs
        self.stream = stream
        _text_source(tokenizer, decode_kwargs)  # a tokenizer that cannot decode fails here, not mid-stream
        self._source = None
        self._next_is_prompt = True
        self._open = True  # a stream ends once; the next put starts a new one

    def put(self, value: torch.Tensor) -> None:
        ids = _token_ids(value)
        if self._source is None:
            self._source = _text_source(self.tokenizer, self.decode_kwargs)
        self._open = True
        if self._next_is_prompt:
            self._next_is_prompt = False
            if self.skip_prompt:
                self._source.prime(ids)
                return
        self.on_finalized_text(self._source.push(ids))

    def end(self) -> None:
        if not self._open:
            return
        text = self._source.flush() if self._source is not None else ""
        self._reset()
        self.on_finalized_text(text, stream_end=True)

    def fail(self, error: BaseException) -> None:
        """Generation failed: finish a line already printed; print nothing if nothing was."""
        if self._source is None:
            self._reset()
        else:
            self.end()

    def _reset(self) -> None:
        self._source = None
        self._next_is_prompt = True
        self._open = False

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        stream = self.stream if self.stream is not None else sys.stdout
        stream.write(text + ("\n" if stream_end else ""))
        stream.flush()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error

    def raise_it(self):
        raise GenerationError(f"generation failed: {type(self.error).__name__}: {self.error}") from self.error


class TextIteratorStreamer(TextStreamer):
    """Makes the text available to another thread as an iterator (``for text in streamer``).

    ``timeout`` bounds each wait: an iterator that waits longer raises ``queue.Empty`` (as in
    transformers) instead of hanging. A failed generation raises :class:`GenerationError` in the
    iterating thread.
    """

    _END = object()

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, timeout: float | None = None, **decode_kwargs: Any):
        super().__init__(tokenizer, skip_prompt, **decode_kwargs)
        self.text_queue: queue.Queue = queue.Queue()
        self.timeout = timeout

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self._deliver(text)
        if stream_end:
            self._deliver(self._END)

    def fail(self, error: BaseException) -> None:
        if not self._open:
            return
        self._reset()
        self._deliver(_Failure(error))

    def _deliver(self, item: Any) -> None:
        self.text_queue.put(item)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        value = self.text_queue.get(timeout=self.timeout)
        if value is self._END:
            raise StopIteration
        if isinstance(value, _Failure):
            value.raise_it()
        return value


class AsyncTextIteratorStreamer(TextIteratorStreamer):
    """The text as an async iterator (``async for text in streamer``) on the event loop that
    created it; generation runs in another thread (``loop.run_in_executor`` or a Thread).

    Create it inside a coroutine (it binds the running loop). ``timeout`` bounds each wait and
    raises ``asyncio.TimeoutError``, as transformers' does.
    """

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, timeout: float | None = None, **decode_kwargs: Any):
        super().__init__(tokenizer, skip_prompt, timeout, **decode_kwargs)
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("AsyncTextIteratorStreamer must be created inside a coroutine (it needs the running "
                               "event loop)") from None
        self.text_queue = asyncio.Queue()

    def _deliver(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.text_queue.put_nowait, item)
        except RuntimeError:
            pass  # the loop is closed: nobody is left to read the stream

    def __iter__(self):
        raise TypeError("AsyncTextIteratorStreamer is iterated with `async for`")

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        value = await asyncio.wait_for(self.text_queue.get(), self.timeout)
        if value is self._END:
            raise StopAsyncIteration
        if isinstance(value, _Failure):
            value.raise_it()
        return value
