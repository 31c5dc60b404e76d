"""One choice of a response: its request's tokens -> the text sent, the logprobs, the finish reason.

``ChoiceText`` turns the manager's cumulative outputs of one request into the increments a
stream sends: ids are decoded incrementally (never half a UTF-8 character), text that could be
the start of a stop string is held back, and everything from the first stop string on is
dropped. A non-streamed response runs the same object once over the final output, so both give
the same text.
"""

from __future__ import annotations

from collections.abc import Sequence

from genfn.tokenizer.gguf_vocab import bytes_to_unicode

from genfn.serve.stoptext import StopTextFilter

__all__ = ["ChoiceText", "chat_logprobs", "completion_logprobs"]

_UNICODE_TO_BYTE = {char: byte for byte, char in bytes_to_unicode().items()}


class ChoiceText:
    def __init__(self, tokenizer, stop: Sequence[str], max_new_tokens: int, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.decoder = tokenizer.incremental_decoder(skip_special_tokens=True)
        self.filter = StopTextFilter(stop)
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.consumed = 0  # tokens of the request already turned into text
        self.finish_reason: str | None = None

    def advance(self, generated: Sequence[int]) -> tuple[str, list[int]]:
        """The text that is now safe to send, and the ids it came from (may be '' with ids)."""
        new = list(generated[self.consumed:])
        self.consumed = len(generated)
        if not new:
            return "", []
        return self.filter.feed(self.decoder.push(new)), new

    def finish(self, generated: Sequence[int]) -> tuple[str, list[int]]:
        """The rest of the text at the request's end; sets ``finish_reason`` (``stop`` / ``length``)."""
        text, new = self.advance(generated)
        text += self.filter.feed(self.decoder.flush())
        text += self.filter.finish()
        ended_early = len(generated) < self.max_new_tokens
        hit_eos = bool(generated) and generated[-1] in self.eos_token_ids
        self.finish_reason = "stop" if (self.filter.stopped or ended_early or hit_eos) else "length"
        return text, new


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _token_bytes(tokenizer, token_id: int, text: str) -> list[int]:
    """The token's own bytes: a byte-level BPE piece may be part of a character, which its decoded
    text (U+FFFD) does not show."""
    if "\ufffd" in text:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if piece and all(char in _UNICODE_TO_BYTE for char in piece):
            return [_UNICODE_TO_BYTE[char] for char in piece]
    return list(text.encode("utf-8"))


def chat_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[float],
                  top_logprobs: Sequence | None) -> dict:
    """The chat format: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``."""
    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        text = _token_text(tokenizer, token_id)
        alternatives = []
        for alt_id, alt_logprob in (top_logprobs[i] if top_logprobs else ()):
            alt_text = _token_text(tokenizer, alt_id)
            alternatives.append({"token": alt_text, "logprob": float(alt_logprob),
                                 "bytes": _token_bytes(tokenizer, alt_id, alt_text)})
        content.append({"token": text, "logprob": float(logprob), "bytes": _token_bytes(tokenizer, token_id, text),
                        "top_logprobs": alternatives})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[float],
                        top_logprobs: Sequence | None, text_offset: int = 0) -> dict:
    """The legacy completions format: parallel lists ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (one ``{token: logprob}`` per token) and ``text_offset``."""
    tokens, offsets, tops = [], [], []
    for i, token_id in enumerate(token_ids):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if top_logprobs:
            tops.append({_token_text(tokenizer, alt_id): float(lp) for alt_id, lp in top_logprobs[i]})
    return {"tokens": tokens, "token_logprobs": [float(lp) for lp in logprobs[:len(token_ids)]],
            "top_logprobs": tops if top_logprobs else None, "text_offset": offsets}
