"""llama.cpp against genfn on the same float weights: where llama.cpp's Python binding is importable
(the ``bench`` extra), a GGUF file written from each family's tiny random model (``test_families``'
writer: llama.cpp's tensor names and conventions) gives llama.cpp greedy tokens equal to genfn's.
llama.cpp keeps its cache in float32 here (its default float16 cache rounds keys and values).

The families llama.cpp (0.3.36's vendored build) runs differently or refuses, and why, are in
``DIFFERENT`` and ``REFUSED``; each is checked to still differ or be refused, so a change on either
side shows up as a failure. Two variants llama.cpp does run are added: Mixtral without its window and
OLMoE with as many kv heads as heads (as the released OLMoE has)."""

from __future__ import annotations

import pytest
import torch

import genfn
from genfn.bench import llamacpp
from conftest import tiny_pair
from test_families import _GGUF_FAMILIES, pair, write_family_gguf

pytest.importorskip("transformers")
pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),
              pytest.mark.skipif(not llamacpp.available(),
                                 reason="llama.cpp's Python binding is not importable: install the `bench` extra "
                                        "(pip install 'genfn[bench]')")]

NEW_TOKENS = 12
# Longer than the windows (5 for Phi-3, 4 for Gemma) and than LongRoPE's original context (8): llama.cpp
# picks LongRoPE's factors by its context size, genfn per forward, and both take the long ones there.
PROMPTS = [[17, 5, 88, 41, 9, 63, 30, 72, 11], [4, 95, 23, 23, 60, 8, 51, 77, 36, 14, 3, 90]]
DIFFERENT = {
    "phi3_window": "llama.cpp turns Phi-3's sliding window off (its log: 'Phi SWA is currently disabled', "
                   "llama.cpp PR 13676) and attends to every key",
    "mixtral": "llama.cpp's llama architecture reads no sliding window (n_swa = 0): every key is attended",
}
REFUSED = {
    "olmoe": "llama.cpp's OLMoE wants its k norm over all heads' dimensions (64): with grouped-query "
             "attention (2 kv heads, a norm of 32) it refuses the file (check_tensor_dims)",
}
VARIANTS = {
    "mixtral_no_window": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmoe_mha": ("OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, num_key_value_heads=4)),
}


def _genfn_tokens(model, prompt):
    out = genfn.generate(model, torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0, disable_compile=True)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", _GGUF_FAMILIES + list(VARIANTS))
def test_llama_cpp_greedy_tokens_equal_genfns(name, tmp_path):
    hf, gm = tiny_pair(VARIANTS[name][0], **VARIANTS[name][1]) if name in VARIANTS else pair(name)
    path = str(write_family_gguf(tmp_path / f"{name}.gguf", hf, vocab=True))
    if name in REFUSED:
        with pytest.raises(RuntimeError, match="could not load"):
            llamacpp.LlamaCpp(path, threads=1, max_sequences=len(PROMPTS), max_len=32)
        return
    engine = llamacpp.LlamaCpp(path, threads=1, max_sequences=len(PROMPTS), max_len=32, float32_cache=True)
    try:
        theirs = engine.generate(PROMPTS, NEW_TOKENS)
    finally:
        engine.close()
    ours = [_genfn_tokens(gm, prompt) for prompt in PROMPTS]
    if name in DIFFERENT:
        assert theirs != ours, f"{name} now agrees with llama.cpp: drop it from DIFFERENT"
    else:
        assert theirs == ours
