"""Prompt sets the benchmarks share (``benchmarks/batching.py``, ``benchmarks/lookup_forwards.py``)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["copy_prompts"]


def copy_prompts(tokenizer, count: int, chars: int) -> list[list[int]]:
    """``count`` copy requests over genfn's own source files: a passage of about ``chars``
    characters (a different file each), then "the same code, copied exactly:" and the passage's
    first line, so a greedy answer repeats the prompt and prompt lookup drafts well."""
    import genfn

    root = Path(genfn.__file__).parent
    files = sorted(p for p in root.rglob("*.py") if p.stat().st_size > 2 * chars)
    prompts = []
    for path in files[:: max(1, len(files) // count)][:count]:
        text = path.read_text()
        start = text.find("\ndef ")
        passage = text[max(start, 0):max(start, 0) + chars].strip()
        first = passage.splitlines()[0]
        prompts.append(tokenizer.encode(f"{passage}\n\n# The same code, copied exactly:\n{first}\n"))
    return prompts
