"""The GGUF loader's fast paths (issue 31): Q4_0/Q4_1/Q8_0 blocks written into the tiles, or
dequantized to floats, by the native kernels (``gguf_tiles.cpp``) bit for bit as numpy's path
writes them, and a load that leaves the process's settings as it found them."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from test_load_memory import _leaves, _same_weight, write_file

import genfn
from genfn import kernels
from genfn.kernels import kquant
from genfn.models.loaders import gguf_blocks
from genfn.models.loaders.gguf import load_gguf_checkpoint
from genfn.models.weight_arena import WeightArena, huge_pages_available
from genfn.quant import KQuantWeight, QuantizedWeight, quantize
from genfn.quant.blocks import gguf_block_fields
from genfn.quant.fuse import cat_rows
from genfn.quant.weight import KERNEL_KIND

needs_kernels = pytest.mark.skipif(not kernels.decode_linear_available(), reason=kernels.kernel_status())


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    # The embedding's and output's 300 rows end half way through a tile; layer 0 has all three
    # tiled formats and llama's permuted q/k rows.
    return write_file(tmp_path_factory.mktemp("loadfast") / "mixed.gguf")


def _gguf_bytes(blocks) -> np.ndarray:
    """A RowBlocks matrix's GGUF records ``[rows, row bytes]`` (scale, minimum, codes per block)."""
    n, nb = blocks.codes.shape[:2]
    parts = [blocks.scales.view(torch.uint8).reshape(n, nb, 2)]
    if blocks.mins is not None:
        parts.append(blocks.mins.view(torch.uint8).reshape(n, nb, 2))
    return torch.cat(parts + [blocks.codes], dim=-1).reshape(n, -1).numpy()


@needs_kernels
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_native_tiles_equal_numpy_tiles_over_garbage(fmt):
    """Into memory that is not zero (the arena need not clear it): rows gathered in a given order,
    the last tile half full, every byte (padding rows included) as numpy's path writes it into
    zeros."""
    torch.manual_seed(0)
    blocks = quantize(torch.randn(40, 96), fmt)
    raw = _gguf_bytes(blocks)
    order = np.random.default_rng(0).permutation(40)
    numpy_weight = QuantizedWeight.zeros(fmt, 40, 96)
    numpy_weight.fill_from_blocks(gguf_block_fields(raw, fmt.upper(), (40, 96))[order])
    native = QuantizedWeight.zeros(fmt, 40, 96, lambda shape, dtype: torch.full(shape, 7, dtype=dtype))
    gguf_blocks._fill_tiles(native, raw, fmt.upper(), order)
    assert _same_weight(native, numpy_weight)
    with pytest.raises(RuntimeError, match="outside the 40 rows"):
        gguf_blocks._fill_tiles(native, raw, fmt.upper(), np.full(40, 40))


@needs_kernels
def test_a_native_load_equals_the_numpy_load_bit_for_bit(mixed_file, monkeypatch):
    native = genfn.load(mixed_file, quantize="gguf").params
    monkeypatch.setattr(gguf_blocks, "native_tiles_available", lambda: False)
    numpy_params = genfn.load(mixed_file, quantize="gguf").params
    (paths, native_leaves, _), (numpy_paths, numpy_leaves, _) = _leaves(native), _leaves(numpy_params)
    assert paths == numpy_paths
    tiled = 0
    for path, a, b in zip(paths, native_leaves, numpy_leaves):
        assert type(a) is type(b) and _same_weight(a, b), path
        tiled += isinstance(a, QuantizedWeight)
    assert tiled >= 4  # the embedding, the output, o_proj, gate/up and down of layer 0


def _process_settings() -> dict:
    """What a library must not change behind its user's back: the environment, torch's threads,
    and the process's transparent-huge-page switch (``prctl(PR_GET_THP_DISABLE)``)."""
    settings = {"environ": dict(os.environ), "threads": torch.get_num_threads(),
                "interop": torch.get_num_interop_threads()}
    libc = ctypes.CDLL(None, use_errno=True)
    pr_get_thp_disable = 42
    settings["thp_disable"] = libc.prctl(pr_get_thp_disable, 0, 0, 0, 0)
    return settings


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux only: reads prctl(PR_GET_THP_DISABLE), which other systems lack")
def test_a_load_leaves_the_process_settings_as_they_were(mixed_file):
    before = _process_settings()
    model = genfn.load(mixed_file, quantize="gguf")
    assert model.params["embed"].shape == (300, 256)
    assert _process_settings() == before


def _file_ranges(path) -> list[tuple[int, int]]:
    """The address ranges where this process maps ``path`` (``/proc/self/maps``)."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == str(path):
                low, high = (int(part, 16) for part in fields[0].split("-"))
                ranges.append((low, high))
    return ranges


def _in_file(tensor: torch.Tensor, path) -> bool:
    """Whether ``tensor``'s bytes lie in this process's mapping of ``path``: used in place, not copied."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return any(low <= start and end <= high for low, high in _file_ranges(path))


# Where a matrix lies is read from /proc/self/maps, which only Linux has (the CI and the benchmark
# machines run it); elsewhere the loads themselves are still checked by the bit-for-bit tests.
needs_proc_maps = pytest.mark.skipif(not os.path.exists("/proc/self/maps"),
                                     reason="Linux only: finds the file mapping in /proc/self/maps")


@needs_proc_maps
@pytest.mark.parametrize("setting", ["default", "GENFN_HUGE_PAGES=0"])
def test_k_quant_matrices_lie_in_the_file_without_huge_pages_and_in_the_arena_with_them(mixed_file, monkeypatch, setting):
    """Without huge pages (switched off, or none to ask for) layer 1's Q6_K down and v projections
    are the file mapping's bytes, not copies; with them (the default where the kernel has them) they
    are written into the arena's huge pages, which the decode streams faster. Either way its Q4_K
    gate/up and q/k (llama's permutation undone) and its Q5_K o projection are repacked 8 rows to a
    group (q4_k_r8, q5_k_r8), which the file layout can then not be used for: written into memory
    of their own; so are the Q6_K ones where q6_k_r8's kernel runs (AVX-512 VNNI)."""
    if setting != "default":
        monkeypatch.setenv("GENFN_HUGE_PAGES", "0")
    huge_pages = huge_pages_available()
    model = genfn.load(mixed_file, quantize="gguf")
    layer = model.params["layers"][1]

    def in_file(weight) -> bool:
        return _in_file(weight.data, mixed_file)

    assert isinstance(layer["w_gate_up"], KQuantWeight) and layer["w_gate_up"].shape == (1024, 256)
    assert layer["w_gate_up"].format == "q4_k_r8" and not in_file(layer["w_gate_up"])
    qk, v = layer["wqkv"].parts  # Q4_K q/k, then the Q6_K v
    assert not in_file(qk)
    assert layer["wo"].format == "q5_k_r8" and not in_file(layer["wo"])
    if kquant.group_kernel_runs("q6_k_r8"):
        assert layer["w_down"].format == v.format == "q6_k_r8" and not in_file(layer["w_down"]) and not in_file(v)
    else:
        assert all(in_file(w) is not huge_pages for w in (layer["w_down"], v))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert torch.isfinite(model(ids).logits).all()


@needs_proc_maps
@pytest.mark.parametrize("head", ["Q4_1", None])
def test_a_k_quant_embedding_moves_to_huge_pages_only_as_the_tied_head(tmp_path, head):
    """A K-quant embedding that a lookup reads one row of per token stays in the file mapping even
    with huge pages; tied (no output matrix in the file) it is also the LM head, read whole every
    step, and goes into the arena with the layers where the arena has huge pages (else it too stays
    in the file)."""
    moved = head is None and huge_pages_available()
    path = write_file(tmp_path / "embed.gguf", embed="Q6_K", output=head)
    model = genfn.load(path, quantize="gguf")
    embed = model.params["embed"]
    assert isinstance(embed, KQuantWeight) and embed.format == "q6_k"
    assert _in_file(embed.data, path) is not moved
    assert torch.isfinite(model(torch.tensor([[3, 1, 4]])).logits).all()


def _random_records(rows: int, cols: int, type_name: str, rng) -> np.ndarray:
    """GGUF records of random codes with random finite float16 scales and minimums (subnormals,
    signed zeros and large values among them): every code and scale bit pattern the kernel meets."""
    block, size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    heads = 2 if type_name == "Q4_1" else 1
    halves = rng.integers(0, 1 << 16, (rows, cols // block, heads), dtype=np.uint16)
    halves[(halves & 0x7C00) == 0x7C00] &= 0xBBFF  # no inf/NaN (a NaN's payload is not a value to compare)
    data[..., :2 * heads] = halves.view(np.uint8).reshape(rows, cols // block, 2 * heads)
    return data.reshape(rows, -1)


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_native_dequantization_equals_the_gguf_package_bit_for_bit(type_name):
    """Rows gathered in a given order into memory that is not zero: every float32 bit as
    ``gguf.quants.dequantize`` computes it (Q4_1's d * u + m rounded twice, never as one FMA)."""
    rng = np.random.default_rng(1)
    raw = _random_records(48, 128, type_name, rng)
    order = rng.permutation(48)
    expected = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, GGMLQuantizationType[type_name])[order]))
    out = torch.full((48, 128), 7.0)
    kind = KERNEL_KIND[type_name.lower()]
    torch.ops.genfn_kernels.gguf_dequantize_rows(torch.from_numpy(raw), torch.from_numpy(order), kind, out)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    with pytest.raises(RuntimeError, match="outside the 48 rows"):
        torch.ops.genfn_kernels.gguf_dequantize_rows(torch.from_numpy(raw), torch.full((48,), 48), kind, out)


def _assert_the_native_load_is_numpys(path, monkeypatch, dtype):
    """``genfn.load(path, dtype=dtype)`` with the native placement equals, bit for bit, the load
    through the gguf package's numpy values (placement turned off), matrices in ``dtype``."""
    native = genfn.load(path, dtype=dtype).params
    monkeypatch.setenv("GENFN_NATIVE_TILES", "0")
    numpy_params = genfn.load(path, dtype=dtype).params
    (paths, native_leaves, _), (numpy_paths, numpy_leaves, _) = _leaves(native), _leaves(numpy_params)
    assert paths == numpy_paths
    for name, a, b in zip(paths, native_leaves, numpy_leaves):
        assert a.dtype == b.dtype == (dtype if a.dim() == 2 else a.dtype), name
        assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                           b.view(torch.int16 if b.element_size() == 2 else torch.int32)), name


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_native_float_load_equals_the_numpy_float_load_bit_for_bit(mixed_file, monkeypatch, dtype):
    """``genfn.load`` without ``quantize``: the Q8_0/Q4_0/Q4_1 matrices dequantized natively into
    the arena equal the gguf package's values (llama's q/k rows unpermuted), layer 0's fused
    q/k/v (Q4_0, Q4_0, Q8_0) is one allocation, and the K-quant layer takes numpy's path."""
    _assert_the_native_load_is_numpys(mixed_file, monkeypatch, dtype)


@pytest.fixture(scope="module")
def float_file(tmp_path_factory):
    # Layer 0 fuses q/k/v of three float types and gate/up of one; llama's q/k rows are permuted.
    types = {0: {"attn_q": "F16", "attn_k": "BF16", "attn_v": "F32", "attn_output": "BF16", "ffn_gate": "F16",
                 "ffn_up": "F16", "ffn_down": "BF16"},
             1: dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), "BF16")}
    return write_file(tmp_path_factory.mktemp("loadfast") / "float.gguf", types, embed="BF16", output="F16")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_matrices_are_copied_into_the_arena_as_the_numpy_load_reads_them(float_file, monkeypatch, dtype):
    """F32/F16/BF16 matrices go from the mapping into the arena in one copy (converted to the load's
    dtype there): bit for bit the gguf package's values through numpy, q/k rows unpermuted, and
    layer 0's q/k/v (F16, BF16, F32) one allocation."""
    arena = WeightArena()
    state_dict = load_gguf_checkpoint(float_file, arena=arena, dtype=dtype).state_dict
    qkv = [state_dict[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]
    assert cat_rows(qkv).data_ptr() == qkv[0].data_ptr()  # fused as a view, not a copy
    assert all(arena.holds(t) for t in qkv) == arena.enabled
    # Layer 1's BF16 down projection loaded as bfloat16 is used where it lies, which the arena holds too.
    assert arena.holds(state_dict["model.layers.1.mlp.down_proj.weight"]) == (arena.enabled or dtype == torch.bfloat16)
    _assert_the_native_load_is_numpys(float_file, monkeypatch, dtype)


_FLOAT_LOAD_AS_AVX2_CPU = """
import torch
from genfn.bench.avx2 import run_as_avx2_cpu
run_as_avx2_cpu()
from genfn import kernels
from genfn.models.loaders.gguf import load_gguf_checkpoint
from genfn.models.weight_arena import WeightArena
arena = WeightArena()
state_dict = load_gguf_checkpoint(FILE, arena=arena, dtype=DTYPE).state_dict
qkv = [state_dict[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]
torch.save({"decode_library": kernels.decode_linear_available(), "arena": arena.enabled,
            "in_arena": [arena.holds(t) for t in qkv], "state_dict": state_dict}, OUT)
"""


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_without_the_decode_library_places_float_matrices_too(float_file, tmp_path, dtype):
    """The float copies need no kernel of the decode library: a process that runs as a CPU without
    AVX-512 (``genfn.bench.avx2``) writes F32/F16/BF16 matrices straight into the arena as well,
    with this process's values, where it once read each through numpy (three writes of the floats)."""
    out = tmp_path / "load.pt"
    script = _FLOAT_LOAD_AS_AVX2_CPU.replace("FILE", repr(str(float_file))).replace("OUT", repr(str(out))).replace(
        "DTYPE", repr(dtype))
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(root)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    there = torch.load(out, weights_only=False)
    assert there["decode_library"] is False
    assert there["in_arena"] == [there["arena"]] * 3
    here = load_gguf_checkpoint(float_file, dtype=dtype).state_dict
    assert here.keys() == there["state_dict"].keys()
    for name, tensor in here.items():
        assert torch.equal(tensor, there["state_dict"][name]), name


_BLOCKS_LOAD_AS_AVX2_CPU = """
import torch
import genfn
from genfn.bench.avx2 import run_as_avx2_cpu
run_as_avx2_cpu()
from genfn import kernels
from genfn.models.loaders import gguf_blocks
kept, floats = genfn.load(FILE, quantize="gguf").params, genfn.load(FILE, dtype=torch.float32).params
torch.save({"decode_library": kernels.decode_linear_available(), "native": gguf_blocks.native_tiles_available(),
            "kept": kept, "floats": floats,
            "lookup": kernels.embedding(torch.tensor([[0, 5, 299]]), kept["embed"], torch.float32)}, OUT)
"""


@needs_kernels
def test_a_cpu_without_the_decode_library_fills_the_tiles_natively(mixed_file, tmp_path, monkeypatch):
    """The loader's tile fill and dequantization (``gguf_tiles.cpp``) build into the AVX2 library too: a
    process that runs as a CPU without AVX-512 loads Q8_0/Q4_0/Q4_1 matrices, kept as tiles or
    dequantized, and looks up rows of a tiled embedding, with this process's bytes and values."""
    out = tmp_path / "load.pt"
    script = _BLOCKS_LOAD_AS_AVX2_CPU.replace("FILE", repr(str(mixed_file))).replace("OUT", repr(str(out)))
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(root)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    there = torch.load(out, weights_only=False)
    assert there["decode_library"] is False and there["native"] is True
    kept, floats = genfn.load(mixed_file, quantize="gguf").params, genfn.load(mixed_file, dtype=torch.float32).params
    for here, theirs in ((kept, there["kept"]), (floats, there["floats"])):
        (paths, leaves, _), (their_paths, their_leaves, _) = _leaves(here), _leaves(theirs)
        assert paths == their_paths
        assert all(_same_weight(a, b) for a, b in zip(leaves, their_leaves)), paths
    assert isinstance(kept["embed"], QuantizedWeight)
    assert torch.equal(kernels.embedding(torch.tensor([[0, 5, 299]]), kept["embed"], torch.float32), there["lookup"])


@needs_kernels
@needs_proc_maps
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("setting", ["default", "GENFN_HUGE_PAGES=0"])
def test_float_matrices_kept_as_stored_are_used_where_they_lie_in_the_file(float_file, monkeypatch, dtype, setting):
    """Without huge pages (switched off, or none to ask for) a BF16 matrix loaded as bfloat16, in the
    file's row order, is the file mapping's bytes, not a copy (layer 1's o and down projections, its
    gate/up run back to back in the file); with them, the layers' matrices are copied into the
    arena's huge pages, which the decode streams faster, and the embedding (the file has its own LM
    head) stays in place. Llama's permuted q/k and every matrix a load converts (F16, or any float
    loaded as float32) are copied."""
    if setting != "default":
        monkeypatch.setenv("GENFN_HUGE_PAGES", "0")
    huge_pages = huge_pages_available()
    model = genfn.load(float_file, dtype=dtype)
    params = model.params

    def in_file(weight: torch.Tensor) -> bool:
        return _in_file(weight, float_file)

    stored_as_loaded = dtype == torch.bfloat16
    in_place = stored_as_loaded and not huge_pages
    one, zero = params["layers"][1], params["layers"][0]
    assert [in_file(one[name]) for name in ("wo", "w_down", "w_gate_up")] == [in_place] * 3
    assert in_file(params["embed"]) == stored_as_loaded
    assert not in_file(one["wqkv"]) and not in_file(zero["w_gate_up"]) and not in_file(params["lm_head"])
    assert in_file(zero["w_down"]) == in_place and not in_file(zero["wqkv"])
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert torch.isfinite(model(ids).logits).all()


@needs_kernels
def test_dequantized_matrices_are_written_into_the_arena_and_fused_as_views(mixed_file):
    arena = WeightArena()
    state_dict = load_gguf_checkpoint(mixed_file, arena=arena).state_dict
    qkv = [state_dict[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]  # Q4_0, Q4_0, Q8_0
    fused = cat_rows(qkv)
    assert fused.shape == (256 + 2 * 128, 256) and fused.data_ptr() == qkv[0].data_ptr()  # a view, not a copy
    assert all(arena.holds(t) for t in (*qkv, state_dict["model.embed_tokens.weight"])) == arena.enabled
    assert not arena.holds(state_dict["model.layers.1.self_attn.q_proj.weight"])  # Q4_K: numpy's path
