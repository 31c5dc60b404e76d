"""genfn.save writes directories transformers loads, with the tokens genfn generates."""

from __future__ import annotations

import json
import os

import pytest
import torch

import genfn
from tests.conftest import tiny_pair


def test_smollm2_gguf_saved_loads_in_transformers_with_same_greedy_tokens(smollm2, tmp_path):
    import transformers

    directory = genfn.save(smollm2, tmp_path / "smollm2")
    names = set(os.listdir(directory))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings and hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    prompt = smollm2.tokenizer(["The capital of France is"], padding_side="left")
    ids, mask = prompt["input_ids"], prompt["attention_mask"]
    ours = genfn.generate(smollm2, ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                          disable_compile=True)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    assert ours.shape[1] > ids.shape[1] + 8  # a real continuation, not an immediate EOS
    assert torch.equal(ours, theirs)
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
    text = "Write a haiku about the sea."
    assert hf_tok(text)["input_ids"] == smollm2.tokenizer.encode(text)
    reloaded = genfn.load(directory)
    assert torch.equal(genfn.generate(reloaded, ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                      disable_compile=True), ours[:, : ids.shape[1] + 8])


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_native_round_trip_equals_transformers_weights(arch, tmp_path):
    import transformers

    hf, model = tiny_pair(arch, seed=4, tie_word_embeddings=False)
    directory = genfn.save(model, tmp_path / arch)
    with open(os.path.join(directory, "config.json")) as f:
        assert json.load(f)["architectures"] == [arch]
    back = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    original = hf.state_dict()
    for name, tensor in back.state_dict().items():
        if name.endswith("inv_freq"):
            continue
        assert torch.equal(tensor, original[name]), name


def test_wrapped_module_saved_and_loaded(tmp_path):
    import transformers

    torch.manual_seed(5)
    config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=64, pad_token_id=0)
    model = genfn.from_module(transformers.GPT2LMHeadModel(config).eval())
    halved = model.to(dtype=torch.bfloat16)
    assert halved.dtype == torch.bfloat16 and model.dtype == torch.float32
    directory = genfn.save(model, tmp_path / "gpt2")
    back = genfn.load(directory)
    ids = torch.tensor([[3, 4, 5, 6]])
    torch.testing.assert_close(back(ids).logits, model(ids).logits)


def test_model_to_returns_new_model_with_cast_params():
    _, model = tiny_pair("LlamaForCausalLM", seed=6)
    half = model.to(dtype=torch.bfloat16)
    assert half is not model and half.dtype == torch.bfloat16 and model.dtype == torch.float32
    assert half.params["inv_freq"].dtype == torch.float32  # rotary table keeps full precision
    same = model.to(torch.float32)
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(same(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="dtype"):
        model.to(dtype="int8")


def test_model_call_logits_equal_transformers():
    hf, model = tiny_pair("LlamaForCausalLM", seed=7)
    ids = torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    ours = model(ids, attention_mask=mask).logits
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(ours[mask.bool()], theirs[mask.bool()], rtol=1e-4, atol=1e-4)


def test_save_refuses_a_file_path(tmp_path):
    _, model = tiny_pair("LlamaForCausalLM")
    target = tmp_path / "file.txt"
    target.write_text("x")
    with pytest.raises(ValueError, match="directory"):
        genfn.save(model, target)
