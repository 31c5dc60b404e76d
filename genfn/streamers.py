"""Streamers: receive tokens as ``generate`` produces them (``put``), then ``end``.

They live in the imperative shell: the driver calls them between steps, never inside one.
Text is decoded incrementally so multi-byte characters split across tokens print whole.
"""

from __future__ import annotations

import queue
import sys
from typing import TextIO

import torch

__all__ = ["BaseStreamer", "TextStreamer", "TextIteratorStreamer"]


class BaseStreamer:
    def put(self, value: torch.Tensor) -> None:
        """Receive the prompt (first call, ``[B, P]``) or the newest tokens (``[B]``)."""

    def end(self) -> None:
        """Generation finished."""


class TextStreamer(BaseStreamer):
    """Writes decoded text to ``stream`` (stdout) as soon as it is complete; batch size 1 only.

    ``skip_prompt``: do not echo the prompt. ``skip_special_tokens`` (and other decode options)
    go to the tokenizer, as in transformers.
    """

    def __init__(self, tokenizer, skip_prompt: bool = False, *, skip_special_tokens: bool = False,
                 stream: TextIO | None = None):
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.skip_special_tokens = skip_special_tokens
        self.stream = stream
        self._decoder = None
        self._next_is_prompt = True

    def put(self, value: torch.Tensor) -> None:
        value = torch.as_tensor(value)
        if value.dim() > 1 and value.shape[0] > 1:
            raise ValueError("TextStreamer only supports batch size 1")
        if self._decoder is None:
            self._decoder = self.tokenizer.incremental_decoder(skip_special_tokens=self.skip_special_tokens)
        ids = value.reshape(-1).tolist()
        if self._next_is_prompt:
            self._next_is_prompt = False
            if self.skip_prompt:
                # Prime the decoder with the prompt so the first new token decodes in context.
                self._decoder.push(ids)
                return
        self.on_finalized_text(self._decoder.push(ids))

    def end(self) -> None:
        if self._decoder is not None:
            self.on_finalized_text(self._decoder.flush(), stream_end=True)
        else:
            self.on_finalized_text("", stream_end=True)
        self._decoder = None
        self._next_is_prompt = True

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        stream = self.stream if self.stream is not None else sys.stdout
        stream.write(text + ("\n" if stream_end else ""))
        stream.flush()


class TextIteratorStreamer(TextStreamer):
    """Makes the text available to another thread as an iterator (``for text in streamer``).

    ``timeout`` bounds each wait: an iterator that waits longer raises ``queue.Empty`` instead
    of hanging forever.
    """

    _END = object()

    def __init__(self, tokenizer, skip_prompt: bool = False, timeout: float | None = None, **kwargs):
        super().__init__(tokenizer, skip_prompt, **kwargs)
        self.text_queue: queue.Queue = queue.Queue()
        self.timeout = timeout

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.text_queue.put(text, timeout=self.timeout)
        if stream_end:
            self.text_queue.put(self._END, timeout=self.timeout)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        value = self.text_queue.get(timeout=self.timeout)
        if value is self._END:
            raise StopIteration
        return value
