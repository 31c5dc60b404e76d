"""The K-quant embedding lookup (``kquant_lookup.cpp``, ``genfn.kernels.kquant.kquant_lookup``): a few rows
of a table in any format the K-quant library holds, as float32, bit for bit the gguf package's values,
eagerly and inside a compiled step, with the torch path where the library is not built."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from genfn import kernels
from genfn.kernels import kquant
from genfn.quant import KQuantWeight
from genfn.quant.kquants import BLOCK_BYTES, BLOCK_INPUTS, INTERLEAVED, repack_r8, unpack_r8

needs_native = pytest.mark.skipif(not kquant.kquant_available(),
                                  reason=f"the K-quant kernels are {kquant.kquant_status()}")

# Where each format keeps its float16 scale(s): d (and Q4_K/Q5_K's dmin) must be finite for the
# values to be compared; every other byte may be anything.
HALVES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_nl": (0,), "iq4_xs": (0,)}


def random_table(fmt: str, rows: int, blocks: int, seed: int) -> KQuantWeight:
    stored = INTERLEAVED.get(fmt, fmt)
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (rows, blocks, BLOCK_BYTES[stored]), dtype=torch.uint8, generator=g)
    for at in HALVES[stored]:
        half = (torch.randn(rows, blocks, 1, generator=g) * 3e-3).to(torch.float16)
        data[..., at:at + 2] = half.view(torch.uint8)
    table = KQuantWeight(data.reshape(rows, -1), stored, rows, BLOCK_INPUTS[stored] * blocks)
    return repack_r8(table) if fmt in INTERLEAVED else table


def gguf_rows(table: KQuantWeight, tokens: torch.Tensor) -> torch.Tensor:
    """The gguf package's float32 values of rows ``tokens`` of ``table`` as the file stores it."""
    stored = unpack_r8(table) if table.format in INTERLEAVED else table
    values = gguf_dequantize(stored.data[tokens].numpy(), GGMLQuantizationType[stored.format.upper()])
    return torch.from_numpy(np.asarray(values, dtype=np.float32))


FORMATS = ("q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs", "q4_k_r8", "q5_k_r8", "q6_k_r8", "iq4_xs_r8")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_lookup_gives_the_gguf_packages_rows_bit_for_bit(fmt):
    table = random_table(fmt, 24, 3, seed=FORMATS.index(fmt))
    tokens = torch.tensor([0, 7, 8, 15, 23, 9, 9, 16])  # ends of groups, a repeat
    rows = kquant.kquant_lookup(table, tokens)
    assert rows.dtype == torch.float32 and rows.shape == (8, table.in_features)
    assert torch.equal(rows, gguf_rows(table, tokens))
    # The model's entry point: any token shape, in the model's dtype.
    looked_up = kernels.embedding(tokens.view(2, 4), table, torch.bfloat16)
    assert looked_up.shape == (2, 4, table.in_features)
    assert torch.equal(looked_up, rows.to(torch.bfloat16).view(2, 4, -1))


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k_r8", "iq4_xs"])
def test_the_torch_path_gives_the_same_rows(fmt, monkeypatch):
    table = random_table(fmt, 16, 2, seed=11)
    tokens = torch.tensor([3, 8, 15, 0])
    native = kquant.kquant_lookup(table, tokens)
    # Off the CPU the torch path runs (meta tensors stand in for another device here).
    elsewhere = KQuantWeight(table.data.to("meta"), table.format, table.out_features, table.in_features)
    rows = kquant.kquant_lookup(elsewhere, tokens.to("meta"))
    assert rows.device.type == "meta" and rows.shape == native.shape and rows.dtype == torch.float32
    monkeypatch.setattr(kquant, "_native", False)  # as where the library is not built
    assert torch.equal(kquant.kquant_lookup(table, tokens), native)
    assert torch.equal(native, gguf_rows(table, tokens))


@needs_native
def test_a_compiled_step_looks_up_with_the_same_bits():
    table = random_table("q6_k_r8", 32, 2, seed=5)
    step = torch.compile(lambda t: kernels.embedding(t, table, torch.float32), fullgraph=True)
    for tokens in (torch.tensor([[31]]), torch.tensor([[0, 12, 12, 25]])):
        assert torch.equal(step(tokens), kernels.embedding(tokens, table, torch.float32))


@needs_native
def test_bad_tokens_and_tables_are_refused():
    table = random_table("q4_k_r8", 16, 1, seed=3)
    with pytest.raises(IndexError, match="index 16 is out of range for 16 rows"):
        kquant.kquant_lookup(table, torch.tensor([2, 16]))
    with pytest.raises(IndexError, match="index -1 is out of range"):
        kquant.kquant_lookup(table, torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="index must be a 1-D integer tensor"):
        kquant.kquant_lookup(table, torch.tensor([1.0]))
    with pytest.raises(RuntimeError, match="format must be 0..8"):
        torch.ops.genfn_kquant.kquant_lookup(table.data, 9, 16, torch.tensor([1]))
    with pytest.raises(RuntimeError, match="data has 16 rows for 12 out_features"):
        torch.ops.genfn_kquant.kquant_lookup(table.data, 5, 12, torch.tensor([1]))
