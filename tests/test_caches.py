"""The cache family: dynamic, static, offloaded, offloaded_static, quantized.

Unit tests drive the caches directly with random keys/values (the same calls the model makes:
``slots``, ``advance``, ``write_layer``); the SmolLM2 tests run the real model through ``generate``.
"""

from __future__ import annotations

import types

import pytest
import torch
from conftest import tiny_pair

import genfn
from genfn.cache import (
    DynamicCache,
    OffloadedCache,
    OffloadedStaticCache,
    QuantizedCache,
    StaticCache,
    make_cache,
)
from genfn.cache.factory import CACHE_IMPLEMENTATIONS
from genfn.cache.offloaded import init_offloaded_cache
from genfn.cache.offloaded_static import init_offloaded_static_cache
from genfn.cache.quantized import dequantize, quantize
from genfn.state.base import tree_flatten
from genfn.strategies.sample import prefill_positions

# SmolLM2-135M's attention shape: 30 layers, 3 KV heads of 64 channels.
SMOL = types.SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
TINY = types.SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=16)

# Measured on SmolLM2 (the 3 prompts, 32 steps on the static cache's greedy tokens,
# residual_length=8, q_group_size=64, float32): int8: max |logit - static logit| 0.435, mean 0.053,
# argmax agrees at every step; int4: max 5.48, mean 0.69, argmax agrees at 87.5% of steps
# (over 64 steps: int8 0.43 / 0.044 / 100%, int4 5.8 / 0.65 / 91%).
# The bounds below leave headroom over those numbers.
INT8_MAX_LOGIT_ERR, INT8_MEAN_LOGIT_ERR = 1.0, 0.1
INT4_MAX_LOGIT_ERR, INT4_MEAN_LOGIT_ERR, INT4_MIN_AGREEMENT = 12.0, 1.5, 0.75


def _feed(cache, steps, batch, spec, generator, num_new=1):
    """Run ``steps`` forwards of ``num_new`` tokens through ``cache`` the way the model does.

    Returns the cache and, per forward, the (K, V) every layer got back, cut to the filled length.
    """
    seen = []
    for _ in range(steps):
        slots = cache.slots(num_new)
        valid = torch.ones(batch, num_new, dtype=torch.bool)
        cache = cache.advance(slots, valid)
        length = int(slots.max()) + 1
        layers = []
        for layer in range(spec.num_layers):
            k = torch.randn(batch, spec.num_kv_heads, num_new, spec.head_dim, generator=generator)
            v = torch.randn(batch, spec.num_kv_heads, num_new, spec.head_dim, generator=generator)
            K, V = cache.write_layer(layer, slots, k, v)
            layers.append((K[:, :, :length].clone(), V[:, :, :length].clone()))
        seen.append(layers)
    return cache, seen


def _make(impl, spec=TINY, batch=2, max_cache_len=24, cache_config=None):
    return make_cache(impl, spec, batch, max_cache_len, torch.float32, "cpu", cache_config)


# --- every cache returns what the static cache returns -------------------------------------------

@pytest.mark.parametrize("impl", ["dynamic", "offloaded", "offloaded_static"])
def test_caches_return_the_static_caches_keys_and_values(impl):
    ref, ref_seen = _feed(_make("static"), 3, 2, TINY, torch.Generator().manual_seed(0), num_new=5)
    cache, seen = _feed(_make(impl), 3, 2, TINY, torch.Generator().manual_seed(0), num_new=5)
    for ref_layers, layers in zip(ref_seen, seen):
        for (rk, rv), (k, v) in zip(ref_layers, layers):
            assert torch.equal(rk, k) and torch.equal(rv, v)
    assert torch.equal(ref.valid[:, :15], cache.valid[:, :15]) and cache.length.tolist() == [15] * cache.batch_size


def test_quantized_cache_returns_quantized_past_and_exact_residual():
    config = {"nbits": 8, "residual_length": 4, "q_group_size": 8}
    _, ref_seen = _feed(_make("static"), 6, 2, TINY, torch.Generator().manual_seed(0), num_new=2)
    cache, seen = _feed(_make("quantized", cache_config=config), 6, 2, TINY, torch.Generator().manual_seed(0),
                        num_new=2)
    # After 12 tokens in forwards of 2 with a window of 4: 8 quantized, the last 4 exact.
    assert (cache.quantized_len, cache.residual_len, cache.max_cache_len) == (8, 4, 12)
    K, _ = seen[-1][0]
    rK, _ = ref_seen[-1][0]
    assert torch.equal(K[:, :, 8:], rK[:, :, 8:])
    step = (rK[:, :, :8].amax(-1) - rK[:, :, :8].amin(-1)).max() / 255  # int8, one group of 8 channels
    assert 0 < (K[:, :, :8] - rK[:, :, :8]).abs().max() <= step / 2 + 1e-6


@pytest.mark.parametrize("nbits", [2, 4, 8])
def test_quantize_round_trip_error_is_half_a_step(nbits):
    x = torch.randn(2, 3, 5, 64, generator=torch.Generator().manual_seed(1)) * 3
    codes, scale, zero = quantize(x, nbits, 32)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == 64 * nbits // 8 and scale.shape[-1] == 2
    err = (dequantize(codes, scale, zero, nbits) - x).abs()
    half_step = scale.repeat_interleave(32, -1) / 2
    assert (err <= half_step + 1e-5).all()


# --- pure updates: static shapes never change, dynamic ones grow by the new tokens ---------------

def _layout(cache):
    leaves, treedef = tree_flatten(cache)
    return treedef, [None if t is None else (tuple(t.shape), t.dtype, t.device) for t in leaves]


@pytest.mark.parametrize("impl", ["static", "offloaded_static"])
def test_static_caches_keep_structure_shapes_and_buffers(impl):
    cache = _make(impl)
    layout = _layout(cache)
    buffers = [name for name in ("keys", "values", "stage_keys", "stage_values", "valid") if hasattr(cache, name)]
    pointers = [getattr(cache, name).data_ptr() for name in buffers]
    generator = torch.Generator().manual_seed(0)
    for num_new in (7, 1, 1, 1):
        cache, _ = _feed(cache, 1, 2, TINY, generator, num_new=num_new)
        assert _layout(cache) == layout
        # length is a fresh [B] tensor each step; every buffer is the donated one, written in place.
        assert [getattr(cache, name).data_ptr() for name in buffers] == pointers
    assert cache.length.tolist() == [10, 10] and cache.max_cache_len == 24


@pytest.mark.parametrize("impl", ["dynamic", "offloaded", "quantized"])
def test_dynamic_caches_grow_by_exactly_the_new_tokens(impl):
    cache = _make(impl, cache_config={"residual_length": 3, "q_group_size": 8} if impl == "quantized" else None)
    assert cache.max_cache_len == 0 and cache.valid.shape == (2, 0)
    generator = torch.Generator().manual_seed(0)
    total = 0
    for num_new in (7, 1, 1, 2, 1):
        before = _layout(cache)[0]
        cache, _ = _feed(cache, 1, 2, TINY, generator, num_new=num_new)
        total += num_new
        assert cache.max_cache_len == total and cache.length.tolist() == [total, total]
        assert cache.valid.shape == (2, total)
        assert _layout(cache)[0] == before  # same pytree structure, only the token axis grew
        if impl != "quantized":
            assert cache.keys.shape == (TINY.num_layers, 2, TINY.num_kv_heads, total, TINY.head_dim)
    if impl == "quantized":
        assert cache.quantized_len + cache.residual_len == total and cache.quantized_len > 0


@pytest.mark.parametrize("impl", ["dynamic", "quantized"])
def test_growing_caches_lengthen_in_their_own_room_and_copy_rarely(impl):
    """A step's new slots are a view into room the buffer was allocated with (no copy of the cache
    every step); the slots already held keep their values and the new ones start at zero."""
    cache = _make(impl, cache_config={"residual_length": 64, "q_group_size": 8} if impl == "quantized" else None)
    name = "rkeys" if impl == "quantized" else "keys"
    generator = torch.Generator().manual_seed(0)
    cache, _ = _feed(cache, 1, 2, TINY, generator, num_new=5)
    storages = {getattr(cache, name).untyped_storage().data_ptr()}
    for _ in range(40):
        held = getattr(cache, name).clone()
        grown = cache.advance(cache.slots(1), torch.ones(2, 1, dtype=torch.bool))
        buffer = getattr(grown, name)
        assert torch.equal(buffer[:, :, :, :-1], held) and not buffer[:, :, :, -1:].any()
        cache, _ = _feed(cache, 1, 2, TINY, generator, num_new=1)
        storages.add(getattr(cache, name).untyped_storage().data_ptr())
    # 45 tokens: room for 64 from the first allocation on, so one storage throughout.
    assert len(storages) == 1


def test_dynamic_rewind_is_a_shorter_view_that_the_next_forward_lengthens():
    generator = torch.Generator().manual_seed(0)
    cache, _ = _feed(_make("dynamic"), 1, 2, TINY, generator, num_new=10)
    storage, held = cache.keys.untyped_storage().data_ptr(), cache.keys[:, :, :, :7].clone()
    cache = cache.rewind(torch.tensor([7, 5]))
    assert cache.max_cache_len == 7 and cache.keys.untyped_storage().data_ptr() == storage
    assert torch.equal(cache.keys, held) and cache.valid.tolist() == [[True] * 7, [True] * 5 + [False] * 2]
    cache, seen = _feed(cache, 1, 2, TINY, generator, num_new=2)
    assert cache.keys.untyped_storage().data_ptr() == storage  # over the forgotten slots, no copy
    assert torch.equal(cache.keys[:, :, :, :7], held)
    assert torch.equal(seen[0][0][0][:, :, 7:], cache.keys[0, :, :, 7:])  # the new slots hold the new keys
    assert cache.valid.tolist() == [[True] * 9, [True] * 5 + [False] * 2 + [True] * 2]


def test_lengthened_views_only_room_it_allocated():
    from genfn.cache.dynamic import lengthened

    grown = lengthened(torch.arange(6.0).view(1, 6), 1, 8)  # a tensor with no room: copied, with room
    assert grown.tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 0.0]]
    again = lengthened(grown, 1, 9)
    assert again.untyped_storage().data_ptr() == grown.untyped_storage().data_ptr()
    assert again.tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 0.0, 0.0]]
    # A slice of some other tensor that is no leading view of a contiguous one (an offset, strides of
    # another shape) is copied, not extended in place.
    other = torch.arange(20.0).view(2, 10)
    for part in (other[:, 2:5], other.t()[:3, :], other[:, ::2]):
        out = lengthened(part, 1, part.shape[1] + 2)
        assert out.untyped_storage().data_ptr() != other.untyped_storage().data_ptr()
        assert torch.equal(out[:, :part.shape[1]], part) and not out[:, part.shape[1]:].any()


# --- reorder (beam search) ---------------------------------------------------------------------

@pytest.mark.parametrize("impl", CACHE_IMPLEMENTATIONS)
def test_reorder_moves_rows_like_the_static_cache(impl):
    beam_idx = torch.tensor([2, 0, 0])
    config = {"nbits": 8, "residual_length": 2, "q_group_size": 8} if impl == "quantized" else None
    cache, _ = _feed(_make(impl, batch=3, cache_config=config), 3, 3, TINY, torch.Generator().manual_seed(0), 2)
    cache = cache.reorder(beam_idx)
    cache, seen = _feed(cache, 1, 3, TINY, torch.Generator().manual_seed(5), 1)
    # Reference: the same cache fed the same history without reordering, rows permuted afterwards.
    plain, _ = _feed(_make(impl, batch=3, cache_config=config), 3, 3, TINY, torch.Generator().manual_seed(0), 2)
    plain, plain_seen = _feed(plain, 1, 3, TINY, torch.Generator().manual_seed(5), 1)
    for (k, v), (pk, pv) in zip(seen[0], plain_seen[0]):
        assert torch.equal(k[:, :, :-1], pk[beam_idx, :, :-1]) and torch.equal(v[:, :, :-1], pv[beam_idx, :, :-1])
        assert torch.equal(k[:, :, -1:], pk[:, :, -1:])  # the new token was written after the reorder
    assert torch.equal(cache.valid, plain.valid[beam_idx])


# --- offload device logic (devices as parameters) ----------------------------------------------

class _Recorder:
    """A copy function that records every transfer and performs the ones with data on both sides."""

    def __init__(self):
        self.events = []

    def __call__(self, dst, src, *, kind, layer):
        self.events.append((kind, layer, src.device.type, dst.device.type, tuple(dst.shape)))
        if "meta" not in (dst.device.type, src.device.type):
            dst.copy_(src)


def _use_layers(cache, recorder, num_new, batch, spec, generator):
    """One forward's cache calls, with a ("use", i) marker when layer ``i`` asks for its keys."""
    slots = cache.slots(num_new)
    cache = cache.advance(slots, torch.ones(batch, num_new, dtype=torch.bool, device=cache.valid.device))
    device = cache.compute_device
    outs = []
    for layer in range(spec.num_layers):
        recorder.events.append(("use", layer))
        k = torch.randn(batch, spec.num_kv_heads, num_new, spec.head_dim, generator=generator).to(device)
        outs.append(cache.write_layer(layer, slots, k, k.clone()))
    return cache, outs


@pytest.mark.parametrize("compute", ["cpu", "meta"])
@pytest.mark.parametrize("impl", ["offloaded", "offloaded_static"])
def test_offload_places_layers_and_prefetches_one_ahead(impl, compute):
    spec, batch = types.SimpleNamespace(num_layers=4, num_kv_heads=2, head_dim=8), 2
    recorder = _Recorder()
    if impl == "offloaded":
        cache = init_offloaded_cache(4, batch, 2, 8, device=compute, offload_device="cpu", copy_fn=recorder)
    else:
        cache = init_offloaded_static_cache(4, batch, 2, 16, 8, device=compute, offload_device="cpu",
                                            copy_fn=recorder)
    generator = torch.Generator().manual_seed(0)
    for num_new in (5, 1):
        recorder.events.clear()
        cache, outs = _use_layers(cache, recorder, num_new, batch, spec, generator)
        # Where things live: every layer offloaded, two staging layers + bookkeeping on the compute device.
        assert cache.keys.device.type == cache.values.device.type == "cpu"
        for t in (cache.stage_keys, cache.stage_values, cache.valid, cache.length, *[x for kv in outs for x in kv]):
            assert t.device.type == compute
        assert cache.stage_keys.shape[0] == 2
        # Which copies, in which order: layer 0 loaded by advance; layer i+1 prefetched while layer i
        # is in use (before layer i+1 asks for it); each layer written back after its update.
        new_len = cache.max_cache_len if impl == "offloaded" else 16
        expected = [("load", 0, "cpu", compute), ("load", 0, "cpu", compute)]
        for layer in range(4):
            expected.append(("use", layer))
            expected += [("writeback", layer, compute, "cpu")] * 2
            if layer + 1 < 4:
                expected += [("prefetch", layer + 1, "cpu", compute)] * 2
        assert [e[:4] if e[0] != "use" else e for e in recorder.events] == expected
        writeback_len = num_new if impl == "offloaded" else 16  # dynamic: only the new tokens go back
        assert {e[4][2] for e in recorder.events if e[0] == "writeback"} == {writeback_len}
        assert {e[4][2] for e in recorder.events if e[0] in ("load", "prefetch")} == {new_len}


@pytest.mark.parametrize("impl", ["offloaded", "offloaded_static"])
def test_offload_compute_memory_does_not_grow_with_layers(impl):
    def compute_bytes(num_layers):
        spec = types.SimpleNamespace(num_layers=num_layers, num_kv_heads=2, head_dim=8)
        cache = make_cache(impl, spec, 2, 16, torch.float32, "cpu")
        cache, _ = _feed(cache, 2, 2, spec, torch.Generator().manual_seed(0), num_new=3)
        staged = cache.stage_keys.numel() * 4 * 2
        return cache.nbytes(), staged + cache.valid.numel() + 8 * cache.length.numel(), cache.keys.numel() * 4 * 2

    total4, staged4, offloaded4 = compute_bytes(4)
    total8, staged8, offloaded8 = compute_bytes(8)
    assert staged4 == staged8 and offloaded8 == 2 * offloaded4
    assert total4 == staged4 + offloaded4 and total8 == staged8 + offloaded8


def test_offloaded_nbytes_by_device():
    cache = make_cache("offloaded_static", TINY, 2, 16, torch.float32, "cpu")
    assert cache.nbytes("cpu") == cache.nbytes() and cache.nbytes("meta") == 0


# --- memory of the quantized cache --------------------------------------------------------------

def test_quantized_cache_bytes_per_token(capsys):
    """Bytes per token beyond the residual window, against a float32 static cache (SmolLM2's shape)."""
    batch, window = 1, 16

    def per_token(cache, chunk, first, second):
        gen = torch.Generator().manual_seed(0)
        cache, _ = _feed(cache, first, batch, SMOL, gen, num_new=chunk)
        low = cache.nbytes()
        cache, _ = _feed(cache, second - first, batch, SMOL, gen, num_new=chunk)
        return (cache.nbytes() - low) / ((second - first) * chunk), cache

    static_bpt = (make_cache("static", SMOL, batch, 200, torch.float32, "cpu").nbytes()
                  - make_cache("static", SMOL, batch, 100, torch.float32, "cpu").nbytes()) / 100
    assert static_bpt == SMOL.num_layers * SMOL.num_kv_heads * SMOL.head_dim * 2 * 4 + batch  # + validity
    lines = [f"float32 static cache: {static_bpt:.0f} bytes/token"]
    limits = {8: 0.3, 4: 0.2, 2: 0.15}
    for nbits, limit in limits.items():
        config = {"nbits": nbits, "residual_length": window, "q_group_size": 64}
        # Forwards of `window` tokens: each one moves the previous window into the quantized part.
        bpt, cache = per_token(make_cache("quantized", SMOL, batch, 0, torch.float32, "cpu", config), window, 2, 6)
        assert cache.residual_len == window and cache.quantized_len == 5 * window
        ratio = bpt / static_bpt
        lines.append(f"int{nbits} (q_group_size 64, float32 scale+zero): {bpt:.0f} bytes/token = {ratio:.3f}x float32"
                     f" (+ {window}-token residual window at float32)")
        assert ratio < limit
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# --- factory validation -------------------------------------------------------------------------

def test_factory_builds_each_implementation():
    kinds = {"dynamic": DynamicCache, "static": StaticCache, "offloaded": OffloadedCache,
             "offloaded_static": OffloadedStaticCache, "quantized": QuantizedCache}
    for name, cls in kinds.items():
        assert isinstance(_make(name), cls)
    assert isinstance(_make(None), DynamicCache)  # transformers' default


def test_unknown_and_deprecated_implementations():
    with pytest.raises(ValueError, match="unknown cache_implementation 'nope'.*'dynamic', 'static'"):
        _make("nope")
    with pytest.raises(ValueError, match="continuous-batching"):
        _make("paged")
    for old, cls in (("sliding_window", StaticCache), ("hybrid", StaticCache),
                     ("offloaded_hybrid", OffloadedStaticCache)):
        with pytest.warns(FutureWarning, match="deprecated"):
            assert isinstance(_make(old), cls)


@pytest.mark.parametrize("impl, config, match", [
    ("quantized", {"nbits": 3}, r"cache_config\['nbits'\] must be one of \(2, 4, 8\)"),
    ("quantized", {"nbits": "8"}, r"'nbits'"),
    ("quantized", {"q_group_size": 6}, r"'q_group_size'\] must be a positive divisor .*head_dim \(16\).*\[1, 2, 4, 8, 16\]"),
    ("quantized", {"q_group_size": 0}, r"'q_group_size'"),
    ("quantized", {"residual_length": -1}, r"'residual_length'\] must be an integer >= 0"),
    ("quantized", {"axis_key": 1}, r"'axis_key'\] must be 0"),
    ("quantized", {"backend": "fp8"}, r"'backend'\] must be one of \('quanto', 'hqq'\)"),
    ("quantized", {"bits": 4}, r"keys \['bits'\].*allowed keys: \['axis_key', 'axis_value', 'backend', 'nbits'"),
    ("static", {"max_cache_len": 10}, r"keys \['max_cache_len'\].*'static'.*GenerationConfig.max_cache_len"),
    ("dynamic", {"offload_device": "cpu"}, r"keys \['offload_device'\].*'dynamic'"),
    ("offloaded", {"offload_device": "nowhere"}, r"cache_config\['offload_device'\] must name a torch device"),
])
def test_bad_cache_config_names_the_field(impl, config, match):
    with pytest.raises(ValueError, match=match):
        _make(impl, cache_config=config)


def test_static_caches_need_a_size():
    with pytest.raises(ValueError, match="max_cache_len must be an integer >= 1"):
        _make("offloaded_static", max_cache_len=0)


def test_generate_uses_the_configured_cache_and_reports_bad_settings():
    _, model = tiny_pair()
    ids = torch.tensor([[5, 6, 7, 8]])
    outs = {impl: model.generate(ids, max_new_tokens=6, cache_implementation=impl, disable_compile=True,
                                 return_dict_in_generate=True)
            for impl in ("dynamic", "offloaded", "static")}
    assert isinstance(outs["dynamic"].cache, DynamicCache) and isinstance(outs["static"].cache, StaticCache)
    assert isinstance(outs["offloaded"].cache, OffloadedCache)
    assert isinstance(model.generate(ids, max_new_tokens=2, return_dict_in_generate=True).cache, DynamicCache)
    assert torch.equal(outs["dynamic"].sequences, outs["static"].sequences)
    with pytest.raises(ValueError, match="nbits"):
        model.generate(ids, max_new_tokens=2, cache_implementation="quantized", cache_config={"nbits": 3})
    with pytest.raises(ValueError, match="cache_implementation"):
        model.generate(ids, max_new_tokens=2, cache_implementation="nope")


# --- SmolLM2: greedy tokens and logits ----------------------------------------------------------

@pytest.fixture(scope="module")
def static_reference(smollm2, smollm2_prompts):
    """The static cache's greedy run: sequences and per-step raw logits."""
    ids, mask = smollm2_prompts["input_ids"], smollm2_prompts["attention_mask"]
    return genfn.generate(smollm2, ids, attention_mask=mask, max_new_tokens=64, cache_implementation="static",
                          disable_compile=True, return_dict_in_generate=True, output_logits=True)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["dynamic", "offloaded", "offloaded_static"])
def test_smollm2_greedy_64_tokens_equal_static(smollm2, smollm2_prompts, static_reference, impl):
    ids, mask = smollm2_prompts["input_ids"], smollm2_prompts["attention_mask"]
    out = genfn.generate(smollm2, ids, attention_mask=mask, max_new_tokens=64, cache_implementation=impl,
                         disable_compile=True)
    assert out.shape[1] == ids.shape[1] + 64 and torch.equal(out, static_reference.sequences)


def _teacher_forced_logits(model, ids, mask, sequence, steps, implementation, cache_config=None):
    """Logits ``[B, steps, V]`` for the tokens of ``sequence`` (prefill, then one token per step)."""
    prompt = ids.shape[1]
    cache = model.init_cache(ids.shape[0], prompt + steps, implementation, cache_config)
    positions = prefill_positions(mask)
    with torch.no_grad():
        logits, cache = model.apply(ids, positions, cache, mask, logits_to_keep=1)
        out, pos = [logits[:, -1]], positions[:, -1]
        for t in range(prompt, prompt + steps - 1):
            pos = pos + 1
            logits, cache = model.apply(sequence[:, t:t + 1], pos.unsqueeze(1), cache)
            out.append(logits[:, -1])
    return torch.stack(out, 1), cache


@pytest.mark.slow
def test_smollm2_quantized_int8_and_int4(smollm2, smollm2_prompts, static_reference, capsys):
    ids, mask = smollm2_prompts["input_ids"], smollm2_prompts["attention_mask"]
    steps, prompt = 32, ids.shape[1]
    config = {"residual_length": 8, "q_group_size": 64}
    ref_tokens = static_reference.sequences
    ref = torch.stack(static_reference.logits[:steps], 1)
    # int8: the greedy tokens match the static cache's for 32 tokens, so both runs saw the same
    # inputs and their logits compare step by step.
    out = genfn.generate(smollm2, ids, attention_mask=mask, max_new_tokens=steps, cache_implementation="quantized",
                         cache_config={**config, "nbits": 8}, return_dict_in_generate=True, output_logits=True)
    assert torch.equal(out.sequences, ref_tokens[:, :prompt + steps])
    assert out.cache.quantized_len >= prompt + steps - 1 - 8  # almost everything was quantized
    int8 = torch.stack(out.logits, 1)
    # int4 drifts off the greedy path, so it is teacher-forced on the static cache's tokens.
    int4, cache = _teacher_forced_logits(smollm2, ids, mask, ref_tokens, steps, "quantized", {**config, "nbits": 4})
    assert cache.quantized_len >= prompt + steps - 1 - 8
    lines = []
    for nbits, logits, max_bound, mean_bound in ((8, int8, INT8_MAX_LOGIT_ERR, INT8_MEAN_LOGIT_ERR),
                                                 (4, int4, INT4_MAX_LOGIT_ERR, INT4_MEAN_LOGIT_ERR)):
        err = (logits - ref).abs()
        agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        lines.append(f"int{nbits}: max |dlogit| {err.max():.3f}, mean {err.mean():.4f}, argmax agreement {agree:.3f}")
        assert err.max() < max_bound and err.mean() < mean_bound
        assert agree == 1.0 if nbits == 8 else agree >= INT4_MIN_AGREEMENT
    with capsys.disabled():
        print("\nquantized cache vs static on SmolLM2 (32 steps, residual_length 8): " + "; ".join(lines))
