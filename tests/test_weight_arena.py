"""genfn.models.weight_arena: a model's weights copied into one buffer advised for huge pages."""

from __future__ import annotations

import torch

import genfn
from genfn.models import weight_arena
from genfn.models.weight_arena import huge_page_bytes, huge_pages_available, place_in_arena
from genfn.quant.blocks import quantize
from genfn.quant.weight import QuantizedWeight
from genfn.state.base import tree_flatten

from conftest import tiny_pair


def _params():
    torch.manual_seed(0)
    embed = torch.randn(50, 16)
    return {
        "embed": embed, "lm_head": embed,  # tied: one tensor twice
        "norm": torch.randn(16, dtype=torch.bfloat16),
        "transposed": torch.randn(8, 12).t(),
        "ids": torch.arange(7),
        "layers": [{"w": torch.randn(3, 16)}, {"w": None}],
        "eps": 1e-5,
    }


def test_the_arena_keeps_every_value_dtype_shape_stride_and_tie():
    params = _params()
    placed = place_in_arena(params)
    if not huge_pages_available():
        assert placed is params
        return
    flat, _ = tree_flatten(params)
    flat_placed, _ = tree_flatten(placed)
    for before, after in zip(flat, flat_placed):
        if isinstance(before, torch.Tensor):
            assert after.dtype == before.dtype and after.shape == before.shape and after.stride() == before.stride()
            assert torch.equal(after, before)
            assert after.data_ptr() % 64 == 0
            assert after.data_ptr() != before.data_ptr()
        else:
            assert after == before or (after is None and before is None)
    assert placed["lm_head"] is placed["embed"]
    _assert_packed_in_one_buffer(flat_placed)
    # The arena holds its own bytes: the originals may change or go.
    params["embed"].add_(1)
    assert not torch.equal(placed["embed"], params["embed"])


def _assert_packed_in_one_buffer(leaves):
    """Distinct tensors (each its own storage: no aliasing for torch.compile), side by side."""
    tensors = {t.data_ptr(): t for t in leaves if isinstance(t, torch.Tensor)}.values()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(spans)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] - spans[0][0] <= sum(end - start for start, end in spans) + 64 * len(spans)


def test_quantized_weights_codes_and_scales_move_into_the_arena():
    torch.manual_seed(1)
    quantized = QuantizedWeight.from_rows(quantize(torch.randn(32, 64), "q4_1"))
    params = {"w": quantized, "norm": torch.ones(64)}
    placed = place_in_arena(params)
    if not huge_pages_available():
        assert placed is params
        return
    assert isinstance(placed["w"], QuantizedWeight)
    assert placed["w"].format == "q4_1" and placed["w"].shape == quantized.shape
    for name in ("codes", "scales", "mins"):
        assert torch.equal(getattr(placed["w"], name), getattr(quantized, name))
    _assert_packed_in_one_buffer([placed["w"].codes, placed["w"].scales, placed["w"].mins, placed["norm"]])
    assert torch.equal(placed["w"].dequantize(), quantized.dequantize())


def test_opaque_and_empty_tensors_stay_where_they_are():
    params = {"w": torch.randn(64, 32), "empty": torch.zeros(0), "sparse": torch.eye(4).to_sparse()}
    if torch.backends.mkldnn.is_available():
        params["mkldnn"] = torch.randn(8, 8).to_mkldnn()
    placed = place_in_arena(params)
    for name in ("empty", "sparse", "mkldnn"):
        if name in params:
            assert placed[name] is params[name]
    assert torch.equal(placed["w"], params["w"])


def test_genfn_huge_pages_0_leaves_the_params_as_they_are(monkeypatch):
    monkeypatch.setenv("GENFN_HUGE_PAGES", "0")
    params = _params()
    assert not huge_pages_available()
    assert place_in_arena(params) is params


def test_without_transparent_huge_pages_nothing_is_copied(monkeypatch, tmp_path):
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(weight_arena, "_THP_MODE", str(mode))
    params = _params()
    assert not huge_pages_available()
    assert place_in_arena(params) is params
    mode.write_text("always [madvise] never\n")
    assert huge_pages_available() == weight_arena.sys.platform.startswith("linux")


def test_a_large_arena_is_backed_by_huge_pages_where_the_kernel_gives_them():
    # Heap memory already written (as after a compile) would take no huge pages: the arena must
    # not land there.
    scratch = [torch.ones(4 << 20) for _ in range(12)]
    del scratch
    params = {f"w{i}": torch.randn(1024, 1024) for i in range(8)}  # 32 MiB
    placed = place_in_arena(params)
    if huge_pages_available():
        # This machine has free memory to spare: most of the 16 aligned 2 MiB pages the arena covers.
        assert huge_page_bytes(placed["w0"]) >= 8 * weight_arena.HUGE_PAGE
        assert all(torch.equal(placed[k], params[k]) for k in params)
    else:
        assert placed is params


def test_loaded_models_hold_their_weights_in_one_arena_and_generate_the_same_tokens():
    hf_model, model = tiny_pair()
    flat = [t for t in tree_flatten(model.params)[0] if isinstance(t, torch.Tensor)]
    if huge_pages_available():
        _assert_packed_in_one_buffer(flat)
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        expected = hf_model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(genfn.generate(model, ids, max_new_tokens=8, do_sample=False), expected)
    cast = model.to(torch.bfloat16)
    flat_cast = [t for t in tree_flatten(cast.params)[0] if isinstance(t, torch.Tensor)]
    if huge_pages_available():
        _assert_packed_in_one_buffer(flat_cast)
    assert cast.params["embed"].dtype == torch.bfloat16


def test_without_huge_pages_a_large_tensor_is_zeroed_by_the_kernel_not_written(monkeypatch):
    """GENFN_HUGE_PAGES=0: a large tensor lies on an anonymous mapping of its own (zero until
    written, with no write of genfn's), not in torch's allocator after a zero fill."""
    monkeypatch.setenv("GENFN_HUGE_PAGES", "0")
    arena = weight_arena.WeightArena()
    assert not arena.enabled
    big, small = arena.empty((512, 1024), torch.float32), arena.empty((3, 4), torch.float16)
    assert big.shape == (512, 1024) and big.dtype == torch.float32 and big.is_contiguous() and not big.any()
    assert small.shape == (3, 4) and not small.any()
    # Memory torch allocated (and zero-filled) is resizable; a buffer's, like the mapping's, is not.
    assert not big.untyped_storage().resizable() and small.untyped_storage().resizable()
    big.fill_(1)
    assert not small.any() and big.sum() == big.numel()
