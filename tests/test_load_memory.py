"""Loading a GGUF file's blocks in place (genfn.models.loaders.gguf_blocks): every code and scale
equal to the old path's (row-major blocks fused, then tiled, then copied into the arena), the
fused parts joined as views of one allocation, and what it costs counted: the bytes the arena
receives, the numpy copies made, and the child process's peak resident memory over the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc

import gguf
import numpy as np
import optree
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

import genfn
from genfn.models import model as model_module
from genfn.models.loaders.gguf import load_gguf_checkpoint, read_gguf
from genfn.models.quantized import quantize_params
from genfn.models.weight_arena import WeightArena, huge_pages_available
from genfn.quant import KQuantWeight, QuantizedWeight, RowBlocks, RowStack, quantize, quantize_k
from genfn.quant.blocks import gguf_block_fields
from genfn.quant.kquants import INTERLEAVED, unpack_r8
from genfn.state.base import NAMESPACE

# Layer 0 mixes formats inside its fused q/k/v (Q4_0, then Q8_0: kept as one Q8_0 run) and uses
# all three 4- and 8-bit tiled formats; layer 1 is a Q4_K_M-like K-quant layer; the embedding (300 rows: a tile ends
# half full) is Q8_0, the untied output Q4_1.
TYPES = {
    0: {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_1",
        "ffn_up": "Q4_1", "ffn_down": "Q8_0"},
    1: {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q4_K",
        "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
}
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 300


def _encode(values: np.ndarray, type_name: str):
    if type_name == "F32":
        return values, None
    qtype = GGMLQuantizationType[type_name]
    if type_name.endswith("_K"):
        return quantize_k(torch.from_numpy(values), type_name.lower()).data.numpy(), qtype
    return gguf_quantize(values, qtype), qtype


def write_file(path, types=TYPES, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS, vocab=VOCAB,
               embed="Q8_0", output="Q4_1", random_bytes=False):
    """A llama GGUF file with random weights in ``types`` per layer (``random_bytes``: blocks of
    random bytes, not quantized values: quick to write at any size)."""
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch="llama")
    for add, value in ((w.add_block_count, len(types)), (w.add_context_length, 256), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0),
                       (w.add_rope_dimension_count, head_dim), (w.add_vocab_size, vocab)):
        add(value)

    def add(name, rows, cols, type_name):
        if random_bytes and type_name != "F32":
            block, size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
            data = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
            data.reshape(rows, -1, size)[..., :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite scales
            w.add_tensor(name, data, raw_dtype=GGMLQuantizationType[type_name])
            return
        data, raw = _encode((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), type_name)
        w.add_tensor(name, data, raw_dtype=raw)

    add("token_embd.weight", vocab, hidden, embed)
    for layer, parts in types.items():
        shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
                  "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
                  "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
        for part, type_name in parts.items():
            add(f"blk.{layer}.{part}.weight", *shapes[part], type_name)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if output is not None:
        add("output.weight", vocab, hidden, output)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    return write_file(tmp_path_factory.mktemp("loadmem") / "mixed.gguf")


def _old_params(path):
    """The path before blocks were placed in the loader: row-major blocks, fused, then tiled."""
    ckpt = load_gguf_checkpoint(path, keep_blocks=True)
    model = model_module._from_state_dict(ckpt.config, ckpt.state_dict, dtype=torch.float32, tokenizer=None,
                                          generation_config=None, source=str(path))
    return quantize_params(model.params, "gguf")


def _leaves(params):
    return optree.tree_flatten_with_path(params, none_is_leaf=True, namespace=NAMESPACE,
                                         is_leaf=lambda x: isinstance(x, (QuantizedWeight, KQuantWeight, RowStack)))


def _same_weight(a, b) -> bool:
    if isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight):
        return (a.format == b.format and a.shape == b.shape and torch.equal(a.codes, b.codes)
                and torch.equal(a.scales, b.scales) and (a.mins is None) == (b.mins is None)
                and (a.mins is None or torch.equal(a.mins, b.mins)))
    if isinstance(a, KQuantWeight) and isinstance(b, KQuantWeight):  # q4_k_r8, q5_k_r8: rows as stored
        a, b = (unpack_r8(w) if w.format in INTERLEAVED else w for w in (a, b))
        return a.format == b.format and torch.equal(a.data, b.data)
    if isinstance(a, RowStack) and isinstance(b, RowStack):
        return len(a.parts) == len(b.parts) and all(map(_same_weight, a.parts, b.parts))
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)


def test_placed_blocks_equal_the_tiled_ones_bit_for_bit(mixed_file):
    old = _old_params(mixed_file)
    new = genfn.load(mixed_file, quantize="gguf").params
    (old_paths, old_leaves, _), (new_paths, new_leaves, _) = _leaves(old), _leaves(new)
    assert old_paths == new_paths
    for path, a, b in zip(new_paths, old_leaves, new_leaves):
        if path == ("layers", 0, "wqkv"):
            # Q4_0 q/k with a Q8_0 v: dequantized to float32 to be fused until session 22, then a
            # RowStack of the two runs, in session 32 one run widened into Q8_0; a RowStack again since
            # session 33 (q/k at their own 4.5 bits). The old path widens the fused RowBlocks.
            assert isinstance(a, QuantizedWeight) and a.format == "q8_0"
            assert isinstance(b, RowStack) and [p.format for p in b.parts] == ["q4_0", "q8_0"]
            assert torch.equal(torch.cat([p.dequantize() for p in b.parts]), a.dequantize())
            continue
        assert type(a) is type(b) and _same_weight(a, b), path
    assert isinstance(new["embed"], QuantizedWeight) and new["embed"].shape == (VOCAB, HIDDEN)  # 300 rows: half a tile


def test_fused_parts_are_views_of_one_allocation(mixed_file):
    params = genfn.load(mixed_file, quantize="gguf").params
    gate_up = params["layers"][0]["w_gate_up"]
    assert isinstance(gate_up, QuantizedWeight) and gate_up.shape == (2 * FFN, HIDDEN)
    k_run = params["layers"][1]["w_gate_up"]
    assert isinstance(k_run, KQuantWeight) and k_run.shape == (2 * FFN, HIDDEN)
    qkv = params["layers"][0]["wqkv"]  # Q4_0 q/k beside a Q8_0 v: two runs, each in its own format
    assert isinstance(qkv, RowStack) and [p.format for p in qkv.parts] == ["q4_0", "q8_0"]
    for weight in (gate_up, k_run, *qkv.parts):
        for t in (weight.codes, weight.scales) if isinstance(weight, QuantizedWeight) else (weight.data,):
            # one allocation from its start: each leaf has its own storage (no aliasing for torch.compile)
            assert t.data_ptr() == t.untyped_storage().data_ptr()
            assert t.untyped_storage().nbytes() <= t.numel() * t.element_size() + 64


def test_the_arena_receives_each_byte_once(mixed_file, monkeypatch):
    """The arena gets the file's kept blocks once (no float copy, no second copy of a placed
    matrix; none of a K-quant matrix used in place), plus the float norms and rotary tables, and
    holds every weight the steps read."""
    allocated, arenas = [], []

    class Counting(WeightArena):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            arenas.append(self)

        def empty(self, shape, dtype):
            allocated.append(int(np.prod(shape)) * dtype.itemsize)
            return super().empty(shape, dtype)

    monkeypatch.setattr(model_module, "WeightArena", Counting)
    params = genfn.load(mixed_file, quantize="gguf").params
    # Without huge pages layer 1's K-quant matrices are used where they lie in the file, but for
    # llama's permuted q/k and the Q4_K gate/up, repacked 8 rows to a group (q4_k_r8); with them,
    # every one is written into the arena once.
    in_place = set() if huge_pages_available() else {f"blk.1.{part}.weight" for part in ("attn_v", "attn_output",
                                                                                         "ffn_down")}
    kept = sum(info.nbytes for name, info in read_gguf(str(mixed_file)).tensors.items()
               if GGMLQuantizationType(info.ggml_type).name != "F32" and name not in in_place)
    floats = sum(leaf.numel() * leaf.element_size() for leaf in optree.tree_leaves(params, namespace=NAMESPACE)
                 if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() <= 1)
    # Tiles pad a matrix to whole tiles of 16 rows: the embedding's and the head's 300 rows to 304.
    padding = 2 * 4 * (HIDDEN // 32) * 34
    floats = floats if huge_pages_available() else 0  # without huge pages the norms stay where they are
    assert kept + floats <= sum(allocated) <= kept + floats + padding
    if huge_pages_available():
        (arena,) = arenas
        for path, leaf in zip(*_leaves(params)[:2]):
            for part in leaf.parts if isinstance(leaf, RowStack) else (leaf,):
                tensors = [part.codes, part.scales] if isinstance(part, QuantizedWeight) else [part.data] \
                    if isinstance(part, KQuantWeight) else [part]
                assert all(arena.holds(t) for t in tensors if isinstance(t, torch.Tensor)), path


def test_numpy_copies_grow_with_the_largest_matrix_not_with_the_file(tmp_path):
    """tracemalloc sees numpy's buffers. Placing the blocks copies a slab of one matrix's fields at
    a time (and a Q/K matrix's rows, gathered to undo llama.cpp's permutation): its peak hardly
    moves from 2 layers to 6, where row-major blocks copied every matrix out of the mapping and
    kept the copies (a peak that grows with the file)."""
    layer = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_1", "ffn_gate": "Q4_1",
             "ffn_up": "Q4_1", "ffn_down": "Q8_0"}

    def traced_peak(path, **kwargs) -> int:
        tracemalloc.start()
        try:
            ckpt = load_gguf_checkpoint(path, keep_blocks=True, **kwargs)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        del ckpt
        return peak

    small, large = (write_file(tmp_path / f"{n}.gguf", {i: layer for i in range(n)}) for n in (2, 6))
    placed = [traced_peak(path, arena=WeightArena()) for path in (small, large)]
    rows = [traced_peak(path) for path in (small, large)]
    assert rows[1] > 2 * rows[0]  # the counter sees the row-major path's copies pile up
    # What still grows is Python's own bookkeeping (the state dict, a few objects per matrix).
    assert placed[1] - placed[0] < 0.1 * (rows[1] - rows[0]) and placed[1] < 0.3 * rows[1]


def test_fill_from_blocks_equals_from_rows_with_a_half_tile():
    torch.manual_seed(0)
    for fmt in ("q4_0", "q4_1", "q8_0"):
        blocks = quantize(torch.randn(40, 96), fmt)  # 2 tiles and 8 rows of a third
        n, nb = blocks.codes.shape[:2]
        parts = [blocks.scales.view(torch.uint8).reshape(n, nb, 2)]
        if blocks.mins is not None:
            parts.append(blocks.mins.view(torch.uint8).reshape(n, nb, 2))
        raw = torch.cat(parts + [blocks.codes], dim=-1).reshape(n, -1).numpy()
        fields = gguf_block_fields(raw, fmt.upper(), (40, 96))
        weight = QuantizedWeight.zeros(fmt, 40, 96)
        weight.fill_from_blocks(fields)
        assert _same_weight(weight, QuantizedWeight.from_rows(blocks)), fmt
        with pytest.raises(ValueError, match="fields must be"):
            weight.fill_from_blocks(fields[:16])
    with pytest.raises(ValueError, match="fmt must be one of"):
        QuantizedWeight.zeros("int4", 16, 64)


def test_row_blocks_from_gguf_bytes_are_unchanged(mixed_file):
    file = read_gguf(str(mixed_file))
    from genfn.quant.blocks import from_gguf_bytes

    rows = from_gguf_bytes(file.raw("blk.0.ffn_up.weight"), "Q4_1", (FFN, HIDDEN))
    assert isinstance(rows, RowBlocks) and rows.codes.shape == (FFN, HIDDEN // 32, 16)
    values = gguf.quants.dequantize(np.ascontiguousarray(file.raw("blk.0.ffn_up.weight")), GGMLQuantizationType.Q4_1)
    from genfn.quant.blocks import dequantize

    assert torch.equal(dequantize(rows), torch.from_numpy(np.asarray(values, np.float32)).reshape(FFN, HIDDEN))


_CHILD = textwrap.dedent("""
    import json, sys
    import torch, genfn
    from genfn import kernels
    from genfn.models.loaders import gguf  # imports and the kernels' load done before the measurement
    kernels.quant_linear_available()

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:  # the peak so far forgotten: only the load counts
        f.write("5")
    before = status("VmRSS:")
    model = genfn.load(sys.argv[1], quantize="gguf")
    print(json.dumps({"before": before, "peak": status("VmHWM:"), "after": status("VmRSS:")}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc peak-RSS reset")
def test_peak_resident_memory_of_a_load_stays_near_the_file(tmp_path):
    """A 36 MB Q4_0/Q8_0 file: the load's peak resident memory over the process's is at most
    1.3x the file (it was ~4x: the mapping, row-major blocks, fused blocks, tiles, then the arena)."""
    layers = {i: {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_0", "ffn_gate": "Q4_0",
                  "ffn_up": "Q4_0", "ffn_down": "Q8_0"} for i in range(4)}
    path = write_file(tmp_path / "big.gguf", layers, hidden=1024, ffn=4096, heads=16, kv_heads=8, vocab=1024,
                      embed="Q8_0", output=None, random_bytes=True)
    size = os.path.getsize(path)
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    assert rss["peak"] - rss["before"] <= 1.3 * size, (rss, size)


def test_weight_arena_hands_out_zeroed_tensors_each_with_its_storage():
    with pytest.raises(ValueError, match="chunk_bytes"):
        WeightArena(chunk_bytes=0)
    arena = WeightArena(chunk_bytes=1 << 20)
    small, big, after = arena.empty((100, 3), torch.float16), arena.empty((3 << 20,), torch.uint8), \
        arena.empty((5,), torch.int32)
    for t, shape, dtype in ((small, (100, 3), torch.float16), (big, (3 << 20,), torch.uint8), (after, (5,), torch.int32)):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
    if arena.enabled:  # a chunk of 1 MiB, then one of 3 MiB for the big tensor, the last one after it
        assert all(arena.holds(t) for t in (small, big, after, big[10:])) and not arena.holds(torch.zeros(3))
        assert len({t.untyped_storage().data_ptr() for t in (small, big, after)}) == 3
        assert all(t.data_ptr() % 64 == 0 for t in (small, big, after))
        small.fill_(1)
        assert not big.any() and not after.any()


def test_a_model_of_placed_blocks_runs_and_matches_the_old_path(mixed_file):
    """The K-quant layer and every tiled matrix are the old path's bits (above); the mixed Q4_0/Q8_0
    q/k/v now runs through the quantized kernels (a RowStack) where the old path multiplied its
    float32 values, so logits agree to the activations' quantization, not bit for bit."""
    model = genfn.load(mixed_file, quantize="gguf")
    old = model_module.Model(model.spec, _old_params(mixed_file), model.apply_fn, model.init_cache_fn)
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    new_logits, old_logits = model(ids).logits, old(ids).logits
    assert new_logits.shape == (1, 6, VOCAB) and torch.isfinite(new_logits).all()
    torch.testing.assert_close(new_logits, old_logits, rtol=0.05, atol=0.05 * old_logits.abs().max().item())


# A Q4_K_M file of a model whose widths are no multiple of 256 (SmolLM2's 576, Qwen2.5-0.5B's 896):
# llama.cpp writes those matrices in Q5_0 (Q8_0 where the mix asks for Q6_K), the rest in K-quants.
Q5_0_TYPES = {0: {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0",
                  "ffn_up": "Q5_0", "ffn_down": "Q6_K"},
              1: {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q5_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0",
                  "ffn_up": "Q5_0", "ffn_down": "Q5_0"}}


def test_q5_0_matrices_are_kept_as_q5_0_tiles_with_their_values_bit_for_bit(tmp_path):
    """Q5_0 was dequantized to float32 on load (32 bits a weight), then kept as Q8_0 tiles (8.5 bits);
    it is kept as its own 5.5 bits now, also where it is fused with a Q8_0 part (layer 0's q/k beside
    its Q8_0 v: a ``RowStack`` of the two), and its values are the gguf package's, through the arena's
    tiles and through ``RowBlocks`` alike."""
    from genfn.quant.blocks import dequantize, from_gguf_bytes

    path = write_file(tmp_path / "q5.gguf", types=Q5_0_TYPES, embed="Q5_0", output=None)
    model = genfn.load(path, quantize="gguf")
    floats = genfn.load(path)
    file = read_gguf(str(path))
    expected = {0: {"wqkv": ["q5_0", "q8_0"], "wo": "q5_0", "w_gate_up": "q5_0"},
                1: {"wqkv": "q5_0", "wo": "q5_0", "w_gate_up": "q5_0", "w_down": "q5_0"}}
    for i, layer in enumerate(model.params["layers"]):
        for name, fmt in expected[i].items():
            parts = layer[name].parts if isinstance(layer[name], RowStack) else (layer[name],)
            assert [p.format for p in parts if isinstance(p, QuantizedWeight)] == ([fmt] if isinstance(fmt, str) else fmt)
            assert torch.equal(torch.cat([p.dequantize() for p in parts]), floats.params["layers"][i][name]), (i, name)
    raw = file.raw("blk.1.attn_output.weight")
    values = gguf.quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType.Q5_0)
    rows = from_gguf_bytes(raw, "Q5_0", (HIDDEN, HIDDEN))
    assert rows.format == "q5_0" and rows.codes.shape == (HIDDEN, HIDDEN // 32, 20)
    assert torch.equal(dequantize(rows), torch.from_numpy(np.asarray(values, np.float32)))
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    assert torch.equal(genfn.generate(model, ids, max_new_tokens=6, do_sample=False, disable_compile=True)[:, :6], ids)
    torch.testing.assert_close(model(ids).logits, floats(ids).logits, rtol=0.05,
                               atol=0.05 * floats(ids).logits.abs().max().item())
