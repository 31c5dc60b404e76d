"""transformers' own SmolLM2 tokenizer (read from the GGUF file), loaded once per test run.

The oracle for stop strings and token healing; a helper module rather than a fixture so that
several test modules share one load.
"""

from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=1)
def hf_smollm2_tokenizer():
    import transformers

    from conftest import smollm2_path

    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
