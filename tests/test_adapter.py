"""genfn.from_module: transformers models wrapped as genfn models give their own generate's tokens."""

from __future__ import annotations

import pytest
import torch

import genfn
from tests.conftest import tiny_hf_model


def _tiny(arch: str, seed: int = 0):
    import transformers

    if arch == "GPT2LMHeadModel":
        torch.manual_seed(seed)
        config = transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
        return transformers.GPT2LMHeadModel(config).eval()
    return tiny_hf_model(arch, seed)[0]


ARCHS = ["LlamaForCausalLM", "GPT2LMHeadModel", "Qwen2ForCausalLM"]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    hf = _tiny(request.param)
    return hf, genfn.from_module(hf)


def _left_padded():
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [3, 4, 9, 5, 6, 7], [0, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    return ids, mask


@pytest.mark.parametrize("settings", [dict(), dict(num_beams=3), dict(num_beams=2, num_return_sequences=2)],
                         ids=["greedy", "beam3", "beam2x2"])
def test_tokens_equal_module_generate(pair, settings):
    hf, model = pair
    ids, mask = _left_padded()
    common = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=2, **settings)
    ours = genfn.generate(model, ids, attention_mask=mask, **common)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, **common)
    assert torch.equal(ours, theirs)


def test_greedy_scores_match_module(pair):
    hf, model = pair
    ids, mask = _left_padded()
    common = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                  output_scores=True)
    ours = genfn.generate(model, ids, attention_mask=mask, **common)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, **common)
    for a, b in zip(ours.scores, theirs.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_sampling_reproducible_per_key(pair):
    _, model = pair
    ids, mask = _left_padded()
    common = dict(max_new_tokens=12, do_sample=True, top_k=0, temperature=1.5, pad_token_id=0)
    first = genfn.generate(model, ids, attention_mask=mask, key=genfn.random.key(7), **common)
    again = genfn.generate(model, ids, attention_mask=mask, key=genfn.random.key(7), **common)
    other = genfn.generate(model, ids, attention_mask=mask, key=genfn.random.key(8), **common)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_static_cache_equals_dynamic(pair):
    hf, model = pair
    ids, mask = _left_padded()
    common = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, disable_compile=True)
    dynamic = genfn.generate(model, ids, attention_mask=mask, **common)
    static = genfn.generate(model, ids, attention_mask=mask, cache_implementation="static", **common)
    assert torch.equal(dynamic, static)


def test_compiled_step_traces_fullgraph():
    """transformers' GPT2 traces under the compiled driver (fullgraph; the eager backend keeps it cheap)."""
    hf = _tiny("GPT2LMHeadModel", seed=3)
    model = genfn.from_module(hf)
    ids, mask = _left_padded()
    common = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    compiled = genfn.generate(model, ids, attention_mask=mask, cache_implementation="static",
                              compile_config=genfn.CompileConfig(fullgraph=True, backend="eager", mode=None), **common)
    assert model.compiled_steps, "the static-cache path did not compile a step"
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, **common)
    assert torch.equal(compiled, theirs)


class _Untraceable(torch.nn.Module):
    """A transformers model behind a forward dynamo cannot trace in one graph."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        torch._dynamo.graph_break()
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                          use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)


def test_untraceable_module_falls_back_to_eager_once(caplog):
    hf = _tiny("LlamaForCausalLM", seed=4)
    model = genfn.from_module(_Untraceable(hf))
    ids, mask = _left_padded()
    common = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    compile_config = genfn.CompileConfig(fullgraph=True, backend="eager", mode=None)
    with caplog.at_level("WARNING", logger="genfn.driver"):
        first = genfn.generate(model, ids, attention_mask=mask, cache_implementation="static",
                               compile_config=compile_config, **common)
        second = genfn.generate(model, ids, attention_mask=mask, cache_implementation="static",
                                compile_config=compile_config, **common)
    fallbacks = [r for r in caplog.records if "does not trace under torch.compile" in r.getMessage()]
    assert len(fallbacks) == 1
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, **common)
    assert torch.equal(first, theirs) and torch.equal(second, theirs)


def test_params_are_a_pytree_the_call_uses():
    """The module's forward runs on the params value, not on the module's own tensors."""
    hf = _tiny("LlamaForCausalLM", seed=1)
    model = genfn.from_module(hf)
    ids = torch.tensor([[3, 4, 5]])
    before = model(ids).logits
    zeroed = {name: torch.zeros_like(t) if name.endswith("norm.weight") and name.startswith("model.norm") else t
              for name, t in model.params.items()}
    changed = genfn.Model(model.spec, zeroed, model.apply_fn, model.init_cache_fn,
                          generation_config=model.generation_config)
    assert changed(ids).logits.abs().max() == 0  # the final norm scales every logit to zero
    torch.testing.assert_close(model(ids).logits, before)
    with torch.no_grad():
        torch.testing.assert_close(before, hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_from_module_rejects_other_values():
    with pytest.raises(TypeError, match="nn.Module"):
        genfn.from_module("gpt2")


def test_module_without_cache_interface_is_refused():
    class NoCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)

        def forward(self, input_ids, cache=None, use_cache=False, **kwargs):
            return (self.embed(input_ids),)

    with pytest.raises(TypeError, match="cache"):
        genfn.from_module(NoCache())


def test_load_unknown_architecture_goes_through_transformers(tmp_path):
    hf = _tiny("GPT2LMHeadModel", seed=2)
    hf.save_pretrained(tmp_path)
    model = genfn.load(tmp_path)
    assert model.spec.architecture == "GPT2LMHeadModel"
    ids, mask = _left_padded()
    common = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, **common)
    assert torch.equal(genfn.generate(model, ids, attention_mask=mask, **common), theirs)


def test_hub_id_is_refused_with_directions():
    with pytest.raises(ValueError, match="hub downloads are not supported.*local directory"):
        genfn.load("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_synced_gpus_accepted():
    hf = _tiny("LlamaForCausalLM")
    model = genfn.from_module(hf)
    ids, mask = _left_padded()
    plain = genfn.generate(model, ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    synced = genfn.generate(model, ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                            synced_gpus=True)
    assert torch.equal(plain, synced)
    with pytest.raises(TypeError, match="synced_gpus"):
        genfn.generate(model, ids, attention_mask=mask, max_new_tokens=4, synced_gpus="yes")


def _custom_generate_dir(root) -> str:
    code = root / "custom_generate"
    code.mkdir(parents=True)
    (code / "helpers.py").write_text("def marker():\n    return 'from the directory'\n")
    (code / "generate.py").write_text(
        "from .helpers import marker\n\n"
        "def generate(model, input_ids, **kwargs):\n"
        "    # the last prompt token repeated three times: a decoding loop genfn would never produce\n"
        "    import torch\n"
        "    tail = input_ids[:, -1:].repeat(1, 3)\n"
        "    return {'sequences': torch.cat([input_ids, tail], dim=1), 'marker': marker(),\n"
        "            'max_new_tokens': kwargs['generation_config'].max_new_tokens}\n")
    return str(root)


def test_custom_generate_directory_needs_trust_remote_code(tmp_path):
    model = genfn.from_module(_tiny("LlamaForCausalLM"))
    directory = _custom_generate_dir(tmp_path / "repo")
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        genfn.generate(model, ids, custom_generate=directory, max_new_tokens=4)
    out = genfn.generate(model, ids, custom_generate=directory, trust_remote_code=True, max_new_tokens=4)
    assert out["marker"] == "from the directory"
    assert out["max_new_tokens"] == 4
    assert out["sequences"].tolist() == [[3, 4, 5, 5, 5, 5]]


def test_custom_generate_directory_without_generate_py(tmp_path):
    model = genfn.from_module(_tiny("LlamaForCausalLM"))
    with pytest.raises(FileNotFoundError, match="custom_generate/generate.py"):
        genfn.generate(model, torch.tensor([[3, 4]]), custom_generate=str(tmp_path), trust_remote_code=True,
                       max_new_tokens=2)


def test_custom_generate_hub_id_offline_is_clear(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: the repository is not there
    model = genfn.from_module(_tiny("LlamaForCausalLM"))
    with pytest.raises(ValueError, match="not in the local Hugging Face cache.*does not download"):
        genfn.generate(model, torch.tensor([[3, 4]]), custom_generate="transformers-community/custom_generate_example",
                       trust_remote_code=True, max_new_tokens=2)


def test_hidden_states_equal_module_generate(pair):
    hf, model = pair
    ids, mask = _left_padded()
    common = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                  output_hidden_states=True)
    ours = genfn.generate(model, ids, attention_mask=mask, **common)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, **common)
    assert len(ours.hidden_states) == len(theirs.hidden_states)
    real = mask.bool()  # what a padding query computes is never read, and differs between attention kernels
    for step, (step_ours, step_theirs) in enumerate(zip(ours.hidden_states, theirs.hidden_states)):
        assert len(step_ours) == len(step_theirs)
        for a, b in zip(step_ours, step_theirs):
            if step == 0:
                a, b = a[real], b[real]
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("implementation", ["quantized", "offloaded"])
def test_other_genfn_caches_bridge_too(implementation):
    hf = _tiny("Qwen2ForCausalLM", seed=9)
    model = genfn.from_module(hf)
    ids, mask = _left_padded()
    common = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ours = genfn.generate(model, ids, attention_mask=mask, cache_implementation=implementation, **common)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, **common)
    assert torch.equal(ours, theirs)


def test_load_without_transformers_names_the_missing_package(tmp_path, monkeypatch):
    import sys

    _tiny("GPT2LMHeadModel").save_pretrained(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ImportError, match="no native implementation of GPT2LMHeadModel.*pip install transformers"):
        genfn.load(tmp_path)
