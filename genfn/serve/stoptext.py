"""Text that is safe to send while a stop string may still be forming.

OpenAI cuts the returned text before the first stop string, so a stream must never send text
that could turn out to be the start of one. ``StopTextFilter.feed`` returns the text that can no
longer become part of a stop string and holds back the longest tail that is a prefix of one;
once a stop string is complete it returns the text before it and then nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopTextFilter", "cut_at_stop"]


class StopTextFilter:
    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(s for s in stop if s)
        self.stopped = False  # a stop string was found; everything after it is dropped
        self._held = ""

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        buffer = self._held + text
        cut = _first_stop(buffer, self.stop)
        if cut is not None:
            self.stopped, self._held = True, ""
            return buffer[:cut]
        keep = _partial_stop_length(buffer, self.stop)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def finish(self) -> str:
        """The end of the text: whatever is held back is not a stop string after all."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` before its first stop string, and whether there was one."""
    cut = _first_stop(text, tuple(s for s in stop if s))
    return (text, False) if cut is None else (text[:cut], True)


def _first_stop(text: str, stop: Sequence[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


def _partial_stop_length(text: str, stop: Sequence[str]) -> int:
    """The length of the longest tail of ``text`` that a stop string starts with (shorter than it)."""
    longest = 0
    for s in stop:
        for size in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:size]):
                longest = size
                break
    return longest
