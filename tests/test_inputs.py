"""genfn.inputs: every kind of bad prompt, mask, special id, length and buffer size is refused
with an error that names the argument, and generate goes through these checks."""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest
import torch

import genfn
from genfn import inputs


# ---- input_ids ---------------------------------------------------------------------------------

@pytest.mark.parametrize("ids,expected", [
    ([5, 6, 7], [[5, 6, 7]]),
    ((5, 6), [[5, 6]]),
    ([[1, 2], [3, 4]], [[1, 2], [3, 4]]),
    (torch.tensor([9, 8], dtype=torch.int32), [[9, 8]]),
    (torch.tensor([[9, 8]], dtype=torch.uint8), [[9, 8]]),
    (np.array([[4, 5]]), [[4, 5]]),
])
def test_as_input_ids_accepts_integer_ids(ids, expected):
    out = inputs.as_input_ids(ids)
    assert out.dtype == torch.int64 and out.tolist() == expected


@pytest.mark.parametrize("ids,error,match", [
    (None, ValueError, "input_ids is required"),
    ([], ValueError, "empty"),
    ([[]], ValueError, "empty"),
    (torch.zeros(0, 3, dtype=torch.long), ValueError, "empty"),
    (torch.zeros(2, 0, dtype=torch.long), ValueError, "empty"),
    (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, r"\[batch, length\]"),
    (torch.tensor(3), ValueError, r"\[batch, length\]"),
    (torch.tensor([[1.0, 2.0]]), TypeError, "float32"),
    (torch.tensor([[True, False]]), TypeError, "bool"),
    (torch.tensor([[1 + 2j]]), TypeError, "complex"),
    ([1.0, 2.0], TypeError, "float 1.0"),
    ([[1, 2], [3, 4.5]], TypeError, "float 4.5"),
    ([True, 2], TypeError, "bool"),
    ([[1, 2], 3], TypeError, "list of rows"),
    ([[1, 2], [3]], ValueError, "different lengths"),
    ("hello", TypeError, "str"),
    (np.array([[0.5]]), TypeError, "float64"),
])
def test_as_input_ids_refuses_what_is_not_token_ids(ids, error, match):
    with pytest.raises(error, match=match) as info:
        inputs.as_input_ids(ids)
    assert "input_ids" in str(info.value)


def test_token_range_names_the_argument():
    inputs.check_token_range(torch.tensor([[0, 9]]), 10)
    with pytest.raises(ValueError, match=r"input_ids .*\[0, 10\).*max 10"):
        inputs.check_token_range(torch.tensor([[0, 10]]), 10)
    with pytest.raises(ValueError, match=r"negative_prompt_ids .*min -1"):
        inputs.check_token_range(torch.tensor([[-1, 3]]), 10, name="negative_prompt_ids")


# ---- special tokens ----------------------------------------------------------------------------

def _config(**ids):
    base = dict(pad_token_id=None, eos_token_id=None, bos_token_id=None, decoder_start_token_id=None)
    return types.SimpleNamespace(**{**base, **ids})


@pytest.mark.parametrize("name", ["pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id"])
def test_special_token_ids_must_be_in_the_vocabulary(name):
    if name == "eos_token_id":
        inputs.check_special_tokens(_config(eos_token_id=-1), 10)
        assert inputs.eos_token_ids([-1, 3]) == (3,)
    inputs.check_special_tokens(_config(**{name: 9}), 10)
    # eos_token_id=-1 means "no EOS" (transformers warns and never stops on it): the one EOS
    # normaliser drops it, for generate and continuous batching alike.
    for bad in (10,) if name == "eos_token_id" else (10, -1):
        with pytest.raises(ValueError, match=rf"{name}={bad} .*\[0, 10\)"):
            inputs.check_special_tokens(_config(**{name: bad}), 10)
    with pytest.raises(TypeError, match=name):
        inputs.check_special_tokens(_config(**{name: 2.0}), 10)


def test_eos_lists_and_pad_fallback():
    assert inputs.eos_token_ids(None) == ()
    assert inputs.eos_token_ids(4) == (4,)
    assert inputs.eos_token_ids([4, 7]) == (4, 7)
    assert inputs.eos_token_ids(torch.tensor([4, 7])) == (4, 7)
    with pytest.raises(ValueError, match="eos_token_id"):
        inputs.check_special_tokens(_config(eos_token_id=[3, 12]), 10)
    with pytest.raises(TypeError, match="eos_token_id"):
        inputs.eos_token_ids([3, "x"])
    assert inputs.resolve_pad_token_id(5, (2,)) == 5
    assert inputs.resolve_pad_token_id(None, (2, 3)) == 2
    assert inputs.resolve_pad_token_id(None, ()) == 0


# ---- attention_mask ----------------------------------------------------------------------------

IDS = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]])


@pytest.mark.parametrize("mask", [
    torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
    torch.tensor([[False, False, True, True], [True, True, True, True]]),
    torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.int32),
    torch.tensor([[0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]),
    [[0, 0, 1, 1], [1, 1, 1, 1]],
])
def test_a_left_padded_mask_passes(mask):
    out = inputs.attention_mask_for(IDS, mask, None, ())
    assert out.dtype == torch.int64 and out.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


@pytest.mark.parametrize("mask,error,match", [
    # A float mask of 0.0/1.0 passes (transformers accepts it); other values do not.
    (torch.tensor([[0.0, 0.5, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]), ValueError, r"only 0 .* and 1 .*\[0.5\]"),
    (torch.tensor([[0, 0, 2, 1], [1, 1, 1, 1]]), ValueError, r"only 0 .* and 1 .*\[2\]"),
    (torch.tensor([[0, 0, 1, 1], [1, 1, 1, -1]]), ValueError, r"\[-1\]"),
    (torch.tensor([[0, 1, 1], [1, 1, 1]]), ValueError, "shape"),
    (torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]), ValueError, r"row\(s\) \[0\] .*right padding.*padding_side='left'"),
    (torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]), ValueError, r"row\(s\) \[0\] .*padding after a real token"),
    (torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]]), ValueError, r"row\(s\) \[1\] are all padding"),
    ("1111", TypeError, "attention_mask"),
])
def test_bad_masks_are_refused(mask, error, match):
    with pytest.raises(error, match=match) as info:
        inputs.attention_mask_for(IDS, mask, None, ())
    assert "attention_mask" in str(info.value)


def test_an_inferred_mask_passes_the_same_checks():
    assert inputs.attention_mask_for(IDS, None, 0, (2,)).tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    right = torch.tensor([[5, 6, 0, 0], [7, 8, 9, 4]])
    with pytest.raises(ValueError, match=r"inferred from pad_token_id=0: row\(s\) \[0\] .*right padding"):
        inputs.attention_mask_for(right, None, 0, (2,))
    empty = torch.tensor([[0, 0, 0, 0], [7, 8, 9, 4]])
    with pytest.raises(ValueError, match=r"inferred from pad_token_id=0: row\(s\) \[0\] are all padding"):
        inputs.attention_mask_for(empty, None, 0, (2,))
    # The pad id is an eos id: padding cannot be told from text, so nothing is inferred.
    assert inputs.attention_mask_for(right, None, 0, (0,)).tolist() == [[1] * 4, [1] * 4]


def test_batched_prompt_without_mask_or_pad_id_logs_like_transformers(caplog):
    with caplog.at_level(logging.WARNING, logger="genfn.inputs"):
        inputs.attention_mask_for(IDS, None, None, (2,))
        inputs.attention_mask_for(IDS[:1], None, None, (2,))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "attention mask and the pad token id were not set" in messages[0]


# ---- lengths and memory ------------------------------------------------------------------------

def test_context_length(caplog):
    inputs.check_prompt_fits(9, 10)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        inputs.check_prompt_fits(10, 10)
    inputs.check_prompt_fits(10_000, None)
    with caplog.at_level(logging.WARNING, logger="genfn.inputs"):
        inputs.warn_beyond_context(10, 10)
        assert not caplog.records
        inputs.warn_beyond_context(1235, 1234)
        inputs.warn_beyond_context(1300, 1234)
    assert [r.getMessage().count("friendly reminder") for r in caplog.records] == [1]
    assert "maximum length (1234)" in caplog.records[0].getMessage()


def test_check_allocation_without_allocating(monkeypatch):
    free = inputs.available_memory()
    assert free is not None and free > 2**20
    inputs.check_allocation(2**20, "a 1 MiB buffer")
    with pytest.raises(ValueError, match=r"the KV cache needs 1,125,899,906,842,624 bytes \(1024.0 TiB\)"):
        inputs.check_allocation(2**50, "the KV cache")
    with pytest.raises(ValueError, match="nbytes"):
        inputs.check_allocation(-1, "x")


def test_check_allocation_falls_back_to_physical_pages(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_psutil(name, *args, **kwargs):
        if name == "psutil":
            raise ImportError("no psutil here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psutil)
    import os

    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert inputs.available_memory() == physical
    with pytest.raises(ValueError, match="host memory"):
        inputs.check_allocation(physical + 1, "the token buffer")


# ---- through generate --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from conftest import tiny_pair

    return tiny_pair()[1]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(input_ids=[[5, 6.0]]), TypeError, "input_ids"),
    (dict(input_ids=torch.tensor([[5, 6]]), attention_mask=torch.tensor([[0.5, 1.0]])), ValueError, r"only 0 \(padding\) and 1 .*\[0.5\]"),
    (dict(input_ids=torch.tensor([[5, 6]]), attention_mask=torch.tensor([[1, 0]])), ValueError, "left padding"),
    (dict(input_ids=torch.tensor([[5, 0]]), pad_token_id=0), ValueError, "inferred from pad_token_id=0"),
    (dict(input_ids=torch.tensor([[5, 6]]), pad_token_id=97), ValueError, "pad_token_id=97"),
    (dict(input_ids=torch.tensor([[5, 6]]), eos_token_id=[2, 300]), ValueError, "eos_token_id"),
    (dict(input_ids=torch.tensor([[5, 6]]), bos_token_id=-4), ValueError, "bos_token_id"),
])
def test_generate_refuses_bad_inputs(tiny, kwargs, error, match):
    with pytest.raises(error, match=match):
        genfn.generate(tiny, max_new_tokens=2, **kwargs)


def test_generate_past_the_context_reminds_once(tiny, caplog):
    inputs._remind_context.cache_clear()
    prompt = torch.randint(6, 97, (1, 250), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="genfn.inputs"):
        out = genfn.generate(tiny, prompt, max_new_tokens=8, eos_token_id=None)
    assert out.shape == (1, 258)
    assert sum("maximum length (256)" in r.getMessage() for r in caplog.records) == 1


def test_kv_cache_size_and_generate_refuses_what_cannot_fit(tiny):
    spec = tiny.spec
    per_slot = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # K and V, float32
    assert inputs.kv_cache_nbytes(tiny, 3, 100) == 3 * 100 * per_slot
    assert inputs.kv_cache_nbytes(object(), 3, 100) is None
    huge = 10**10
    with pytest.raises(ValueError, match=r"KV cache and token buffer for 1 row\(s\) x 10000000003 positions .* needs "
                                         rf"{(huge + 3) * (per_slot + 8):,} bytes"):
        genfn.generate(tiny, torch.tensor([[5, 6, 7]]), max_new_tokens=huge, eos_token_id=None)
    inputs.check_generation_memory(tiny, 1, huge, "offloaded_static")  # lives on the host: not bounded here
