"""A tensor-parallel rank reads only its slices of a checkpoint (GGUF: byte ranges of the file
mapping, quantized blocks kept; safetensors: ``get_slice``), and gets exactly the params that
slicing the whole checkpoint gives. Loading a shard needs no process group, so this runs in one
process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import genfn
from genfn.models.loaders import CheckpointError, load_checkpoint
from genfn.models.loaders.gguf import load_gguf_checkpoint, read_gguf
from genfn.models.model import _from_state_dict
from genfn.models.quantized import quantize_params
from genfn.models.tensor_parallel import TensorShard
from genfn.state.base import tree_flatten

transformers = pytest.importorskip("transformers")
from test_loaders import tiny_model, write_gguf  # noqa: E402

# 3 KV heads over 2 ranks (an uneven split, as SmolLM2's), head_dim 32: every cut between 32-blocks
SIZES = dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=3, intermediate_size=128)
Q8_0 = {f"blk.{i}.{n}.weight" for i in range(2)
        for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")} | {"token_embd.weight"}




def _whole_then_sliced(path, shard, quantize):
    """The params the loader built before it read slices: the whole checkpoint, then cut."""
    ckpt = (load_gguf_checkpoint(path, keep_blocks=True) if quantize == "gguf" else load_checkpoint(path))
    model = _from_state_dict(ckpt.config, ckpt.state_dict, dtype=torch.float32, tokenizer=None,
                             generation_config=None, source=None, tensor_shard=shard)
    return model.spec, quantize_params(model.params, quantize) if quantize else model.params


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_loading")
    model = tiny_model("llama", tied=True, **SIZES)
    model.save_pretrained(root / "hf")
    return {"hf": root / "hf", "gguf_f32": write_gguf(root / "f32.gguf", model),
            "gguf_q8_0": write_gguf(root / "q8.gguf", model, quantize=Q8_0)}


def _check_sliced_read(path, shard, quantize):
    """``genfn.load(path, tensor_shard=shard)`` (only the rank's slices read) equals the whole
    checkpoint loaded and then cut; returns the loaded model."""
    spec, params = _whole_then_sliced(path, shard, quantize)
    loaded = genfn.load(path, quantize=quantize, tensor_shard=shard)
    assert loaded.spec == spec
    (mine, tree), (reference, reference_tree) = tree_flatten(loaded.params), tree_flatten(params)
    assert tree == reference_tree  # the same structure, formats and shapes
    for a, b in zip(mine, reference):
        assert (a is None and b is None) or (a.shape == b.shape and torch.equal(a, b))
    return loaded


@pytest.mark.parametrize("kind, quantize", [("hf", None), ("gguf_f32", None), ("gguf_q8_0", "gguf"),
                                            ("gguf_q8_0", None)])
@pytest.mark.parametrize("rank", [0, 1])
def test_sliced_read_equals_the_sliced_checkpoint(checkpoints, kind, quantize, rank):
    loaded = _check_sliced_read(checkpoints[kind], TensorShard(rank, 2, "g"), quantize)
    assert loaded.spec.num_kv_heads == (1, 2)[rank]


_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    """OLMo 2 (q/k norm weights cut with the heads), Phi-4-mini (fused q/k/v and gate/up, read
    part by part) and Gemma 3: a safetensors directory and a GGUF file with Q8_0 linears each."""
    from test_families import _GGUF_ARCH, _gguf_name, pair, write_family_gguf

    root = tmp_path_factory.mktemp("tp_families")
    out = {}
    for name in ("olmo2", "phi4_mini", "gemma3_llama_cpp"):
        hf, _ = pair(name)
        hf.save_pretrained(root / name)
        names = {g for g in (_gguf_name(_GGUF_ARCH[type(hf).__name__], n) for n in hf.state_dict())
                 if g.endswith(".weight") and g.split(".")[-2] in _LINEARS}
        out[name] = {"hf": root / name, "gguf": write_family_gguf(root / f"{name}.gguf", hf, frozenset(names))}
    return out


@pytest.mark.parametrize("name", ["olmo2", "phi4_mini", "gemma3_llama_cpp"])
@pytest.mark.parametrize("kind, quantize", [("hf", None), ("gguf", "gguf")])
def test_a_familys_sliced_read_equals_the_sliced_checkpoint(family_checkpoints, name, kind, quantize):
    loaded = _check_sliced_read(family_checkpoints[name][kind], TensorShard(1, 2, "g"), quantize)
    assert loaded.spec.num_kv_heads == 1 and loaded.spec.tensor_shard.rank == 1


def test_a_slice_is_a_view_of_the_file(checkpoints):
    """Only the slice's bytes are touched: rows and whole blocks of columns are views of the mapping."""
    gguf = read_gguf(str(checkpoints["gguf_q8_0"]))
    whole = gguf.raw("blk.0.attn_output.weight")  # [96 rows, 3 blocks x 34 bytes]
    columns = gguf.raw("blk.0.attn_output.weight", (1, 32, 96))
    rows = gguf.raw("blk.0.attn_q.weight", (0, 32, 96))
    assert columns.shape == (96, 2 * 34) and rows.shape == (64, 3 * 34)
    assert np.shares_memory(columns, whole) and np.array_equal(columns, whole[:, 34:])
    assert gguf.shape("blk.0.attn_output.weight", (1, 32, 96)) == (96, 64)


def test_a_slice_through_a_block_is_refused(checkpoints):
    gguf = read_gguf(str(checkpoints["gguf_q8_0"]))
    with pytest.raises(CheckpointError, match="blk.0.ffn_down.weight.*Q8_0 blocks of 32.*cut a block"):
        gguf.raw("blk.0.ffn_down.weight", (1, 0, 48))


def test_a_wrong_shape_is_named_before_any_slice_is_read(tmp_path):
    model = tiny_model("llama", tied=True, **SIZES)
    model.save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text().replace('"intermediate_size": 128', '"intermediate_size": 64')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match="mlp.gate_proj.weight has shape \\[128, 96\\]"):
        genfn.load(tmp_path, tensor_shard=TensorShard(0, 2, "g"))
