"""Encoder-decoder models: native T5 / BART against transformers (logits, greedy, beam, outputs),
sampling per key, the compiled static-cache step, and the errors for bad encoder-decoder inputs."""

from __future__ import annotations

import pytest
import torch

import genfn
from genfn.cache.encoder_decoder import EncoderDecoderCache
from genfn.models.model import EncoderDecoderModel

VOCAB = 96

# name -> (transformers classes, config overrides)
FAMILIES = {
    "t5": ("T5", dict()),
    "t5_v1_1": ("T5", dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    "mt5": ("MT5", dict()),
    "bart": ("Bart", dict()),
    "bart_scaled": ("Bart", dict(scale_embedding=True, activation_function="gelu_new")),
}


def _hf_model(family: str, seed: int = 0):
    import transformers

    prefix, overrides = FAMILIES[family]
    torch.manual_seed(seed)
    if prefix in ("T5", "MT5"):
        config = getattr(transformers, f"{prefix}Config")(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
            pad_token_id=0, eos_token_id=1, **overrides)
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    else:
        config = transformers.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64,
            forced_eos_token_id=None, **overrides)
        model = transformers.BartForConditionalGeneration(config)
    _spread_weights(model)
    # Eager attention: transformers returns attention maps only from it.
    model.set_attn_implementation("eager")
    return model.eval()


def _spread_weights(model) -> None:
    """Redraw every weight wider than transformers' init (which gives tiny models near-uniform logits
    and one repeated token), so greedy and beam search have real choices to get wrong; norm weights
    and biases move off 1 and 0 (BART's final_logits_bias included)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.6)
            elif "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("final_logits_bias"):
                buffer.normal_(0.0, 0.5)


_PAIRS: dict = {}


def pair(family: str, tmp_path_factory):
    """(transformers model, genfn model loaded from its save_pretrained directory)."""
    if family not in _PAIRS:
        hf = _hf_model(family)
        directory = tmp_path_factory.mktemp(family)
        hf.save_pretrained(directory)
        _PAIRS[family] = (hf, genfn.load(directory))
    return _PAIRS[family]


@pytest.fixture(params=sorted(FAMILIES))
def models(request, tmp_path_factory):
    return pair(request.param, tmp_path_factory)


@pytest.fixture
def t5(tmp_path_factory):
    return pair("t5", tmp_path_factory)


@pytest.fixture
def bart(tmp_path_factory):
    return pair("bart", tmp_path_factory)


def _batch(seed: int = 1, rows: int = 3, length: int = 9):
    """Encoder ids with right padding on one row (the usual side for encoder inputs)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    if rows > 1:
        mask[1, length - 3:] = 0
        ids[1, length - 3:] = 0
    return ids, mask


def test_loads_as_an_encoder_decoder_model(models):
    _, model = models
    assert isinstance(model, EncoderDecoderModel) and model.is_encoder_decoder


@pytest.mark.parametrize("cache_implementation", ["static", "dynamic"])
def test_logits_match_transformers_at_encoder_prefill_and_every_cached_step(models, cache_implementation):
    hf, model = models
    ids, mask = _batch()
    decoder_ids = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)
        encoded = model.encode(ids, mask)
        torch.testing.assert_close(encoded.last_hidden_state, ref.encoder_last_hidden_state, atol=1e-4, rtol=1e-4)
        keys, values = model.cross_attention_kv(encoded.last_hidden_state)
        cache = EncoderDecoderCache(model.init_cache(3, 16, cache_implementation), keys, values, mask.bool())
        positions = torch.arange(6).expand(3, 6)
        logits, cache = model.apply(decoder_ids[:, :3], positions[:, :3], cache)
        torch.testing.assert_close(logits, ref.logits[:, :3], atol=1e-4, rtol=1e-4)
        for t in range(3, 6):
            logits, cache = model.apply(decoder_ids[:, t:t + 1], positions[:, t:t + 1], cache)
            torch.testing.assert_close(logits[:, 0], ref.logits[:, t], atol=1e-4, rtol=1e-4)


GENERATE_SETTINGS = [
    dict(),
    dict(num_beams=3),
    dict(num_beams=2, num_return_sequences=2, length_penalty=0.7),
    dict(encoder_no_repeat_ngram_size=2, encoder_repetition_penalty=1.7),
    dict(num_beams=3, encoder_no_repeat_ngram_size=2, encoder_repetition_penalty=0.6),
    dict(forced_bos_token_id=7, no_repeat_ngram_size=2),
]


@pytest.mark.parametrize("settings", GENERATE_SETTINGS, ids=lambda s: ",".join(s) or "greedy")
def test_greedy_and_beam_tokens_equal_transformers(models, settings):
    hf, model = models
    ids, mask = _batch()
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, **settings)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, **settings)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_per_row_decoder_start_token_id_equals_transformers(models, num_beams):
    hf, model = models
    ids, mask = _batch()
    starts = [0, 5, 11]
    settings = dict(max_new_tokens=8, do_sample=False, num_beams=num_beams, decoder_start_token_id=starts,
                    encoder_repetition_penalty=1.3)
    ref = hf.generate(input_ids=ids, attention_mask=mask, **settings)
    out = model.generate(ids, attention_mask=mask, **settings)
    assert out[:, 0].tolist() == starts
    assert torch.equal(out, ref)
    # A tensor of start ids is the same request.
    as_tensor = {**settings, "decoder_start_token_id": torch.tensor(starts)}
    out_tensor = model.generate(ids, attention_mask=mask, **as_tensor)
    assert torch.equal(out_tensor, out)


def test_decoder_input_ids_are_routed_to_the_decoder(t5):
    hf, model = t5
    ids, mask = _batch()
    decoder_ids = torch.tensor([[0, 9, 4], [0, 3, 3], [0, 20, 8]])
    ref = hf.generate(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, max_new_tokens=6,
                      do_sample=False)
    out = model.generate(ids, attention_mask=mask, decoder_input_ids=decoder_ids, max_new_tokens=6)
    assert torch.equal(out, ref) and torch.equal(out[:, :3], decoder_ids)
    # Without the start token in front, it is prepended (as transformers does).
    out_prepended = model.generate(ids, attention_mask=mask, decoder_input_ids=decoder_ids[:, 1:] + 1, max_new_tokens=6)
    assert out_prepended[:, 0].tolist() == [0, 0, 0]


@pytest.mark.parametrize("num_beams", [1, 2])
def test_precomputed_encoder_outputs_skip_the_encoder(bart, num_beams):
    _, model = bart
    ids, mask = _batch()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=num_beams)
    encoded = model.encode(ids, mask)
    calls = []
    original = model.encode_fn
    model.encode_fn = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    try:
        out = model.generate(ids, attention_mask=mask, encoder_outputs=encoded, max_new_tokens=6, num_beams=num_beams)
    finally:
        model.encode_fn = original
    assert torch.equal(out, expected) and not calls


def test_unknown_decoder_kwarg_and_bad_start_ids_are_clear_errors(t5):
    _, model = t5
    ids, mask = _batch()
    with pytest.raises(ValueError, match="decoder_head_mask"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, decoder_head_mask=torch.ones(2))
    with pytest.raises(ValueError, match="decoder_start_token_id has 2 values but the batch has 3 rows"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, decoder_start_token_id=[0, 1])
    with pytest.raises(ValueError, match="guidance_scale are not supported with encoder-decoder"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, guidance_scale=2.0)
    with pytest.raises(ValueError, match="assisted generation .* not supported with encoder-decoder"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, prompt_lookup_num_tokens=2)


def test_return_dict_outputs_match_transformers(bart):
    hf, model = bart
    ids, mask = _batch()
    settings = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True,
                    output_attentions=True, output_hidden_states=True)
    ref = hf.generate(input_ids=ids, attention_mask=mask, **settings)
    out = model.generate(ids, attention_mask=mask, **settings)
    assert type(out).__name__ == "GenerateEncoderDecoderOutput"
    assert torch.equal(out.sequences, ref.sequences)
    for mine, theirs in zip(out.scores, ref.scores, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(out.encoder_hidden_states, ref.encoder_hidden_states, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(out.encoder_attentions, ref.encoder_attentions, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    for name in ("decoder_attentions", "cross_attentions", "decoder_hidden_states"):
        steps, ref_steps = getattr(out, name), getattr(ref, name)
        assert len(steps) == len(ref_steps), name
        for step, ref_step in zip(steps, ref_steps):
            for mine, theirs in zip(step, ref_step, strict=True):
                torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4, msg=name)


def test_beam_return_dict_is_the_beam_encoder_decoder_output(t5):
    hf, model = t5
    ids, mask = _batch()
    settings = dict(max_new_tokens=6, num_beams=3, do_sample=False, return_dict_in_generate=True, output_scores=True,
                    output_hidden_states=True)
    ref = hf.generate(input_ids=ids, attention_mask=mask, **settings)
    out = model.generate(ids, attention_mask=mask, **settings)
    assert type(out).__name__ == "GenerateBeamEncoderDecoderOutput"
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=1e-4, rtol=1e-4)
    assert torch.equal(out.beam_indices, ref.beam_indices)
    for mine, theirs in zip(out.encoder_hidden_states, ref.encoder_hidden_states, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_sampling_is_reproducible_per_key_and_batch_independent(t5):
    _, model = t5
    ids, mask = _batch()
    settings = dict(max_new_tokens=8, do_sample=True, top_k=0, temperature=1.5)
    first = model.generate(ids, attention_mask=mask, key=genfn.random.key(3), **settings)
    again = model.generate(ids, attention_mask=mask, key=genfn.random.key(3), **settings)
    other = model.generate(ids, attention_mask=mask, key=genfn.random.key(4), **settings)
    assert torch.equal(first, again) and not torch.equal(first, other)
    # Row 2 alone with its own row key gives the tokens it had in the batch.
    row_keys = genfn.random.as_row_keys(genfn.random.key(3), 3)
    alone = model.generate(ids[2:], attention_mask=mask[2:], key=row_keys[2:], **settings)
    assert torch.equal(alone[0], first[2, :alone.shape[1]])


@pytest.mark.parametrize("num_beams", [1, 3])
def test_static_and_dynamic_caches_give_transformers_tokens(bart, num_beams):
    hf, model = bart
    ids, mask = _batch()
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, num_beams=num_beams)
    for implementation in ("static", "dynamic"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=num_beams,
                             cache_implementation=implementation, disable_compile=True)
        assert torch.equal(out, ref), implementation


def test_compiled_static_cache_step_equals_eager(t5):
    _, model = t5
    ids, mask = _batch()
    # Plain inductor (no autotuning): the test is about equality and compiling once, not speed.
    settings = dict(cache_implementation="static", compile_config=genfn.CompileConfig(
        fullgraph=True, mode=None, options={"max_autotune": False}))
    torch._dynamo.reset()
    model.compiled_steps.clear()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = model.generate(ids, attention_mask=mask, max_new_tokens=6, **settings)
    other_ids, other_mask = _batch(seed=5)
    other = model.generate(other_ids, attention_mask=other_mask, max_new_tokens=6, **settings)
    assert len(model.compiled_steps) == 1, "one compiled step serves every step of both calls"
    assert counters["stats"]["unique_graphs"] == 1
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=6, **{**settings, "disable_compile": True})
    other_eager = model.generate(other_ids, attention_mask=other_mask, max_new_tokens=6,
                                 **{**settings, "disable_compile": True})
    assert torch.equal(compiled, eager) and torch.equal(other, other_eager)


def test_streamer_sees_the_decoder_tokens(t5):
    _, model = t5
    ids, mask = _batch(rows=1)

    class Collect:
        def __init__(self):
            self.values, self.ended = [], False

        def put(self, value):
            self.values.extend(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=7, streamer=streamer)
    assert streamer.ended and streamer.values == out[0].tolist()
