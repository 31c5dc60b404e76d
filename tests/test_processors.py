"""genfn.processors against transformers' logits processors (the oracle).

Every genfn processor runs on the full static buffer, whose columns past ``cur_len`` hold
garbage; transformers' runs on ``input_ids = tokens[:, :cur_len]``. They must agree.
"""

from __future__ import annotations

import math

import pytest
import torch

import transformers.generation.logits_process as hf
from genfn.processors import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsContext,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    ProcessorChain,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    WatermarkDetector,
    WatermarkLogitsProcessor,
    build_logits_processors,
    greenlist_ids,
    guidance_combine,
    synthid_mean_score,
)

V = 50
PAD = 0


# ---------------------------------------------------------------------------------------------
# inputs


def make_batch(seed: int, *, batch=4, width=24, cur_len=14, prompt_len=8, token_range=V, pads=(0, 1, 3, 5)):
    """A left-padded static buffer with garbage past ``cur_len``, and random logits.

    Returns ``(ctx, logits, input_ids, attention_mask)``; ``input_ids`` is what transformers sees.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, token_range, (batch, width), generator=g)
    mask = torch.ones((batch, prompt_len), dtype=torch.int64)
    for row in range(batch):
        pad = pads[row % len(pads)] if prompt_len > 1 else 0
        pad = min(pad, prompt_len - 1)
        tokens[row, :pad] = PAD
        mask[row, :pad] = 0
    tokens[:, cur_len:] = torch.randint(-(10**6), 10**6, (batch, width - cur_len), generator=g)
    logits = torch.randn((batch, V), generator=g) * 3
    ctx = LogitsContext(tokens=tokens, cur_len=torch.tensor(cur_len), prompt_len=torch.tensor(prompt_len))
    return ctx, logits, tokens[:, :cur_len].clone(), mask


def check(ours, theirs, ctx, logits, input_ids):
    expected = theirs(input_ids.clone(), logits.clone())
    got = ours(logits.clone(), ctx)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0, equal_nan=True)
    return got


SHAPES = [
    dict(cur_len=14, prompt_len=8),
    dict(cur_len=8, prompt_len=8),  # the first decode step
    dict(cur_len=1, prompt_len=1),  # decoder start only
    dict(cur_len=3, prompt_len=2, token_range=4),  # short, many repeats
    dict(cur_len=20, prompt_len=6, token_range=5),  # long, many repeats
]


@pytest.fixture(params=range(len(SHAPES)), ids=[f"{s['cur_len']}of{s.get('prompt_len')}" for s in SHAPES])
def batch(request):
    return make_batch(100 + request.param, **SHAPES[request.param])


# ---------------------------------------------------------------------------------------------
# one processor at a time


def pairs(ctx, input_ids, mask):
    """(id, genfn processor, transformers processor) for every processor with fixed arguments."""
    p_len = int(ctx.prompt_len)
    pad_lengths = (mask != 0).int().argmax(dim=1)
    prompt_ids = ctx.tokens[:, :p_len]
    eos = [3, 7]
    return [
        ("temperature", TemperatureLogitsWarper(0.7), hf.TemperatureLogitsWarper(0.7)),
        ("top_k", TopKLogitsWarper(5), hf.TopKLogitsWarper(5)),
        ("top_k>V", TopKLogitsWarper(500), hf.TopKLogitsWarper(500)),
        ("top_k_keep", TopKLogitsWarper(2, min_tokens_to_keep=4), hf.TopKLogitsWarper(2, min_tokens_to_keep=4)),
        ("top_p", TopPLogitsWarper(0.8), hf.TopPLogitsWarper(0.8)),
        ("top_p=1", TopPLogitsWarper(1.0), hf.TopPLogitsWarper(1.0)),
        ("top_p_keep", TopPLogitsWarper(0.1, min_tokens_to_keep=3), hf.TopPLogitsWarper(0.1, min_tokens_to_keep=3)),
        ("min_p", MinPLogitsWarper(0.1), hf.MinPLogitsWarper(0.1)),
        ("min_p_keep", MinPLogitsWarper(0.9, min_tokens_to_keep=3), hf.MinPLogitsWarper(0.9, min_tokens_to_keep=3)),
        ("top_h", TopHLogitsWarper(0.4), hf.TopHLogitsWarper(0.4)),
        ("typical", TypicalLogitsWarper(0.7), hf.TypicalLogitsWarper(0.7)),
        (
            "typical_keep",
            TypicalLogitsWarper(0.2, min_tokens_to_keep=4),
            hf.TypicalLogitsWarper(0.2, min_tokens_to_keep=4),
        ),
        ("epsilon", EpsilonLogitsWarper(0.02), hf.EpsilonLogitsWarper(0.02)),
        (
            "epsilon_keep",
            EpsilonLogitsWarper(0.5, min_tokens_to_keep=3),
            hf.EpsilonLogitsWarper(0.5, min_tokens_to_keep=3),
        ),
        ("eta", EtaLogitsWarper(0.05), hf.EtaLogitsWarper(0.05)),
        ("eta_keep", EtaLogitsWarper(0.5, min_tokens_to_keep=3), hf.EtaLogitsWarper(0.5, min_tokens_to_keep=3)),
        ("repetition", RepetitionPenaltyLogitsProcessor(1.5), hf.RepetitionPenaltyLogitsProcessor(1.5)),
        ("repetition<1", RepetitionPenaltyLogitsProcessor(0.6), hf.RepetitionPenaltyLogitsProcessor(0.6)),
        (
            "repetition_ignore_int",
            RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=3),
            hf.RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=3),
        ),
        (
            "repetition_ignore_pads",
            RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=pad_lengths),
            hf.RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=pad_lengths),
        ),
        (
            "encoder_repetition_ctx",
            EncoderRepetitionPenaltyLogitsProcessor(1.7),
            hf.EncoderRepetitionPenaltyLogitsProcessor(1.7, prompt_ids),
        ),
        (
            "encoder_repetition_const",
            EncoderRepetitionPenaltyLogitsProcessor(0.8, prompt_ids[:2]),
            hf.EncoderRepetitionPenaltyLogitsProcessor(0.8, prompt_ids[:2]),
        ),
        ("no_repeat_1", NoRepeatNGramLogitsProcessor(1), hf.NoRepeatNGramLogitsProcessor(1)),
        ("no_repeat_2", NoRepeatNGramLogitsProcessor(2), hf.NoRepeatNGramLogitsProcessor(2)),
        ("no_repeat_3", NoRepeatNGramLogitsProcessor(3), hf.NoRepeatNGramLogitsProcessor(3)),
        (
            "enc_no_repeat_2_ctx",
            EncoderNoRepeatNGramLogitsProcessor(2),
            hf.EncoderNoRepeatNGramLogitsProcessor(2, prompt_ids),
        ),
        (
            "enc_no_repeat_1_ctx",
            EncoderNoRepeatNGramLogitsProcessor(1),
            hf.EncoderNoRepeatNGramLogitsProcessor(1, prompt_ids),
        ),
        (
            "enc_no_repeat_3_const",
            EncoderNoRepeatNGramLogitsProcessor(3, prompt_ids[:2]),
            hf.EncoderNoRepeatNGramLogitsProcessor(3, prompt_ids[:2]),
        ),
        (
            "sequence_bias",
            SequenceBiasLogitsProcessor.create(
                [[[4], 2.5], [[1, 2], -1.5], [[2, 3], 3.0], [[1, 2, 2], 1.25], [[3, 2], -0.5]]
            ),
            hf.SequenceBiasLogitsProcessor(
                [[[4], 2.5], [[1, 2], -1.5], [[2, 3], 3.0], [[1, 2, 2], 1.25], [[3, 2], -0.5]]
            ),
        ),
        (
            "bad_words",
            NoBadWordsLogitsProcessor.create([[3], [7], [1, 2], [2, 1, 3], [4, 4], [9]], eos_token_id=eos),
            hf.NoBadWordsLogitsProcessor([[3], [7], [1, 2], [2, 1, 3], [4, 4], [9]], eos_token_id=eos),
        ),
        ("min_length", MinLengthLogitsProcessor(12, eos), hf.MinLengthLogitsProcessor(12, eos)),
        (
            "min_new_tokens",
            MinNewTokensLengthLogitsProcessor(None, 4, eos),
            hf.MinNewTokensLengthLogitsProcessor(p_len, 4, eos),
        ),
        (
            "min_new_tokens_static",
            MinNewTokensLengthLogitsProcessor(3, 2, eos),
            hf.MinNewTokensLengthLogitsProcessor(3, 2, eos),
        ),
        ("forced_bos", ForcedBOSTokenLogitsProcessor(5), hf.ForcedBOSTokenLogitsProcessor(5)),
        (
            "forced_eos_now",
            ForcedEOSTokenLogitsProcessor(int(ctx.cur_len) + 1, eos),
            hf.ForcedEOSTokenLogitsProcessor(int(ctx.cur_len) + 1, eos),
        ),
        ("forced_eos_later", ForcedEOSTokenLogitsProcessor(30, 9), hf.ForcedEOSTokenLogitsProcessor(30, 9)),
        ("inf_nan", InfNanRemoveLogitsProcessor(), hf.InfNanRemoveLogitsProcessor()),
        (
            "exp_decay",
            ExponentialDecayLengthPenalty.from_config((2, 1.3), eos),
            hf.ExponentialDecayLengthPenalty((2, 1.3), eos, p_len),
        ),
        (
            "exp_decay_static",
            ExponentialDecayLengthPenalty.from_config((0, 0.8), [3], input_ids_seq_length=1),
            hf.ExponentialDecayLengthPenalty((0, 0.8), [3], 1),
        ),
        ("suppress", SuppressTokensLogitsProcessor((1, 4, 9)), hf.SuppressTokensLogitsProcessor([1, 4, 9])),
        (
            "begin_suppress",
            SuppressTokensAtBeginLogitsProcessor((2, 3)),
            hf.SuppressTokensAtBeginLogitsProcessor([2, 3], p_len),
        ),
        (
            "begin_suppress_offset",
            SuppressTokensAtBeginLogitsProcessor((2, 3), begin_offset=1),
            hf.SuppressTokensAtBeginLogitsProcessor([2, 3], p_len + 1),
        ),
        ("normalize", LogitNormalization(), hf.LogitNormalization()),
    ]


PAIR_IDS = [name for name, _, _ in pairs(*[make_batch(0)[i] for i in (0, 2, 3)])]


@pytest.mark.parametrize("name", PAIR_IDS)
def test_processor_matches_transformers(name, batch):
    ctx, logits, input_ids, mask = batch
    _, ours, theirs = next(p for p in pairs(ctx, input_ids, mask) if p[0] == name)
    # Both ways: the processor as built (transformers' Python values, 0-d lengths), and its
    # per-row form (every number a [B] leaf) on [B] lengths.
    per_row = ours.per_row(logits.shape[0])
    rows_ctx = ctx.replace(cur_len=ctx.row_cur_len().clone(), prompt_len=ctx.row_prompt_len().clone())
    check(ours, theirs, ctx, logits, input_ids)
    check(per_row, theirs, rows_ctx, logits, input_ids)
    # rows with -inf entries (as after an earlier truncation), and a row entirely -inf
    masked = logits.masked_fill(torch.rand(logits.shape, generator=torch.Generator().manual_seed(1)) < 0.3, -math.inf)
    if name not in ("top_h", "eta", "eta_keep"):  # transformers' Categorical rejects all--inf rows
        masked[0] = -math.inf
    check(ours, theirs, ctx, masked, input_ids)
    check(per_row, theirs, rows_ctx, masked, input_ids)


def test_inf_nan_removed():
    ctx, logits, input_ids, _ = make_batch(5)
    logits[0, :5] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, math.nan])
    logits[2] = math.nan
    out = check(InfNanRemoveLogitsProcessor(), hf.InfNanRemoveLogitsProcessor(), ctx, logits, input_ids)
    assert torch.isfinite(out).all()


def test_processors_ignore_garbage_columns():
    """Whatever lies past cur_len never changes a result."""
    ctx, logits, input_ids, mask = make_batch(7, token_range=5)
    other = LogitsContext(
        tokens=torch.where(ctx.filled_mask(), ctx.tokens, torch.randint(0, 5, ctx.tokens.shape)),
        cur_len=ctx.cur_len,
        prompt_len=ctx.prompt_len,
    )
    for name, ours, _ in pairs(ctx, input_ids, mask):
        assert torch.equal(ours(logits, ctx), ours(logits, other)), name


@pytest.mark.parametrize("seed", [0, 1])
def test_per_row_parameters_match_per_request_transformers(seed):
    ctx, logits, input_ids, _ = make_batch(seed)
    temps, ks, ps, mins, pens = (
        [0.5, 1.0, 1.7, 0.9],
        [3, 0, 500, 1],
        [0.5, 1.0, 0.95, 0.2],
        [0.0, 0.2, 0.05, 1.0],
        [1.2, 0.7, 1.0, 2.0],
    )
    cases = [
        (TemperatureLogitsWarper(torch.tensor(temps)), [hf.TemperatureLogitsWarper(t) for t in temps]),
        (
            TopKLogitsWarper(torch.tensor(ks), min_tokens_to_keep=2),
            [hf.TopKLogitsWarper(k, min_tokens_to_keep=2) if k else None for k in ks],
        ),
        (
            TopPLogitsWarper(torch.tensor(ps, dtype=torch.float64)),
            [hf.TopPLogitsWarper(p) if p < 1 else None for p in ps],
        ),
        (MinPLogitsWarper(torch.tensor(mins)), [hf.MinPLogitsWarper(m) for m in mins]),
        (RepetitionPenaltyLogitsProcessor(torch.tensor(pens)), [hf.RepetitionPenaltyLogitsProcessor(p) for p in pens]),
    ]
    for ours, per_row in cases:
        got = ours(logits.clone(), ctx)
        for row, theirs in enumerate(per_row):
            want = (
                logits[row : row + 1]
                if theirs is None
                else theirs(input_ids[row : row + 1], logits[row : row + 1].clone())
            )
            torch.testing.assert_close(got[row : row + 1], want, atol=1e-6, rtol=0)


def test_prefix_constrained_is_eager_and_matches():
    ctx, logits, input_ids, _ = make_batch(3)

    def allowed(batch_id, sent):
        return [int(sent[-1]) % V, (batch_id * 7 + len(sent)) % V, 11]

    ours = PrefixConstrainedLogitsProcessor(allowed, num_beams=2)
    assert not ours.compile_safe
    check(ours, hf.PrefixConstrainedLogitsProcessor(allowed, num_beams=2), ctx, logits, input_ids)
    # unsatisfiable rows fall back to the bare mask
    logits[:2] = -math.inf
    check(ours, hf.PrefixConstrainedLogitsProcessor(allowed, num_beams=2), ctx, logits, input_ids)


def test_validation_errors():
    with pytest.raises(ValueError):
        TemperatureLogitsWarper(0.0)
    with pytest.raises(ValueError):
        TopKLogitsWarper(0)
    with pytest.raises(ValueError):
        TopPLogitsWarper(1.5)
    with pytest.raises(ValueError):
        NoRepeatNGramLogitsProcessor(0)
    with pytest.raises(ValueError, match="sequence_bias"):
        SequenceBiasLogitsProcessor.create({(1, 60): 1.0}, vocab_size=V)
    with pytest.raises(ValueError, match="bad_words_ids"):
        NoBadWordsLogitsProcessor.create([[1, 60]], vocab_size=V)


def test_bad_words_of_only_eos_is_a_no_op_like_transformers():
    ctx, logits, input_ids, _ = make_batch(4)
    ours = NoBadWordsLogitsProcessor.create([[3]], eos_token_id=3)
    out = check(ours, hf.NoBadWordsLogitsProcessor([[3]], eos_token_id=3), ctx, logits, input_ids)
    assert torch.equal(out, logits)


def test_guidance_combine():
    cond, uncond = torch.randn(2, V), torch.randn(2, V)
    want = 1.5 * (cond.log_softmax(-1) - uncond.log_softmax(-1)) + uncond.log_softmax(-1)
    torch.testing.assert_close(guidance_combine(cond, uncond, 1.5), want)
    torch.testing.assert_close(guidance_combine(cond, uncond, 1), cond.log_softmax(-1))


# ---------------------------------------------------------------------------------------------
# the chain built from a config


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        bos_token_id=1,
        eos_token_id=3,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(config).eval()


def transformers_config(prompt_len: int, eos: list[int], **kwargs):
    """A transformers GenerationConfig with defaults and lengths resolved as ``generate`` does."""
    from transformers import GenerationConfig, SynthIDTextWatermarkingConfig

    if kwargs.get("watermarking_config") == "synthid":  # a dict would become a (Kirchenbauer) WatermarkingConfig
        kwargs["watermarking_config"] = SynthIDTextWatermarkingConfig(
            ngram_len=2, keys=[5, 9, 13], context_history_size=4
        )
    config = GenerationConfig(**kwargs)
    config.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    config.max_length = prompt_len + (config.max_new_tokens or 20)
    if config.min_new_tokens is not None:
        config.min_length = config.min_new_tokens + prompt_len
    config._eos_token_tensor = torch.tensor(eos) if eos else None
    return config


CHAIN_CONFIGS = {
    "greedy_defaults": dict(),
    "greedy_penalties": dict(
        repetition_penalty=1.3,
        no_repeat_ngram_size=2,
        bad_words_ids=[[4], [1, 2], [3]],
        min_new_tokens=3,
        min_length=5,
        encoder_repetition_penalty=1.2,
        encoder_no_repeat_ngram_size=3,
        sequence_bias=[[[6], 1.5], [[2, 6], -2.0]],
    ),
    "sample_all_warpers": dict(
        do_sample=True,
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        min_p=0.02,
        typical_p=0.95,
        epsilon_cutoff=0.001,
        eta_cutoff=0.001,
        top_h=0.9,
    ),
    "beam_sample_keep": dict(do_sample=True, num_beams=2, top_k=2, top_p=0.3, temperature=1.0),
    "forcing": dict(
        forced_bos_token_id=5,
        forced_eos_token_id=[3, 8],
        remove_invalid_values=True,
        exponential_decay_length_penalty=(1, 1.5),
        suppress_tokens=[9, 10],
        begin_suppress_tokens=[11],
        renormalize_logits=True,
        max_new_tokens=7,
    ),
    "watermark": dict(do_sample=True, top_k=10, watermarking_config={"greenlist_ratio": 0.3, "bias": 1.5}),
    "synthid": dict(do_sample=True, top_k=10, watermarking_config="synthid"),
}
CHAIN_CASES = [(name, 6) for name in CHAIN_CONFIGS] + [("forcing", 1)]  # prompt of 1: begin index after forced BOS


@pytest.mark.parametrize("name,prompt_len", CHAIN_CASES)
def test_chain_matches_get_logits_processor(name, prompt_len, tiny_llama):
    kwargs = dict(CHAIN_CONFIGS[name])
    num_beams = kwargs.get("num_beams", 1)
    eos = [3]
    config = transformers_config(prompt_len, eos, **kwargs)
    for cur_len in (prompt_len, prompt_len + 2, config.max_length - 1):
        ctx, logits, input_ids, mask = make_batch(
            7 + cur_len, batch=4, cur_len=cur_len, prompt_len=prompt_len, width=32, token_range=12
        )
        prompt = input_ids[:, :prompt_len]
        theirs = tiny_llama._get_logits_processor(
            generation_config=config,
            input_ids_seq_length=prompt_len,
            encoder_input_ids=prompt[::num_beams] if num_beams > 1 else prompt,
            logits_processor=hf.LogitsProcessorList(),
            device="cpu",
            model_kwargs={"attention_mask": mask},
        )
        ours = build_logits_processors(
            config,
            prompt_len=prompt_len,
            max_length=config.max_length,
            min_length=config.min_length,
            eos_token_ids=eos,
            num_beams=num_beams,
            attention_mask=mask,
            vocab_size=V,
        )
        assert [type(p).__name__ for p in ours] == [type(p).__name__ for p in theirs]
        for mine, hf_p in zip(ours, theirs):
            assert getattr(mine, "min_tokens_to_keep", None) == getattr(hf_p, "min_tokens_to_keep", None)
        if ours.stateful:  # SynthID: one step from a fresh state equals transformers' first call
            got, _ = ours.apply(logits.clone(), ctx, ours.init_state(logits.shape[0]))
            torch.testing.assert_close(got, theirs(input_ids, logits.clone()), atol=1e-6, rtol=0)
        else:
            check(ours, theirs, ctx, logits, input_ids)


def test_chain_user_processors_merge_like_transformers(tiny_llama):
    prompt_len, eos = 6, [3]
    config = transformers_config(prompt_len, eos, do_sample=True, top_k=5, min_new_tokens=2, no_repeat_ngram_size=2)
    ctx, logits, input_ids, mask = make_batch(11, cur_len=7, prompt_len=prompt_len, token_range=8)
    theirs = tiny_llama._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=prompt_len,
        logits_processor=hf.LogitsProcessorList(
            [hf.NoRepeatNGramLogitsProcessor(1), hf.SuppressTokensLogitsProcessor([2]), hf.TopKLogitsWarper(3)]
        ),
        device="cpu",
        model_kwargs={"attention_mask": mask},
    )
    user = [NoRepeatNGramLogitsProcessor(1), SuppressTokensLogitsProcessor((2,)), TopKLogitsWarper(3)]
    common = dict(prompt_len=prompt_len, max_length=config.max_length, min_length=config.min_length, eos_token_ids=eos)
    ours = build_logits_processors(config, user_processors=user, attention_mask=mask, **common)
    assert [type(p).__name__ for p in ours] == [type(p).__name__ for p in theirs]
    assert ours[0] is user[0]  # the user's processor took the config-built one's slot
    check(ours, theirs, ctx, logits, input_ids)

    with pytest.raises(ValueError, match="custom logits processor"):
        build_logits_processors(config, user_processors=user, on_duplicate="raise", **common)


def test_chain_reports_model_level_features():
    config = transformers_config(4, [3], guidance_scale=1.5, token_healing=True)
    chain = build_logits_processors(config, prompt_len=4, max_length=24, min_length=0, eos_token_ids=[3])
    assert dict(chain.requires) == {"guidance_scale": 1.5, "token_healing": True}
    assert len(chain) == 0


def test_chain_is_a_pytree():
    from genfn.state import tree_flatten, tree_unflatten

    chain = ProcessorChain((TemperatureLogitsWarper(torch.tensor([0.5, 2.0])), TopKLogitsWarper(3)))
    leaves, treedef = tree_flatten(chain)
    assert any(isinstance(x, torch.Tensor) for x in leaves)
    rebuilt = tree_unflatten(treedef, leaves)
    ctx, logits, _, _ = make_batch(0, batch=2)
    assert torch.equal(rebuilt(logits, ctx), chain(logits, ctx))


# ---------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_chain_compiles_fullgraph_without_recompiles(backend):
    chain = ProcessorChain(
        (
            RepetitionPenaltyLogitsProcessor(1.3),
            TemperatureLogitsWarper(0.7),
            TopKLogitsWarper(10),
            TopPLogitsWarper(0.9),
            MinPLogitsWarper(0.05),
        )
    )

    def step(logits, tokens, cur_len, prompt_len):
        return chain(logits, LogitsContext(tokens=tokens, cur_len=cur_len, prompt_len=prompt_len))

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    ctx, logits, _, _ = make_batch(1, width=24, cur_len=17)  # valid tokens up to column 17
    args = (ctx.tokens, torch.tensor(10), ctx.prompt_len)
    assert torch.equal(compiled(logits, *args), step(logits, *args))
    with torch.compiler.set_stance("fail_on_recompile"):
        for cur_len in (11, 17):
            args = (ctx.tokens, torch.tensor(cur_len), ctx.prompt_len)
            assert torch.equal(compiled(logits, *args), step(logits, *args))


def test_every_compile_safe_processor_traces_fullgraph():
    ctx, logits, input_ids, mask = make_batch(2, cur_len=10, prompt_len=6, token_range=8)
    everything = [p for _, p, _ in pairs(ctx, input_ids, mask)]
    everything.append(WatermarkLogitsProcessor.create(V, seeding_scheme="lefthash"))
    everything.append(WatermarkLogitsProcessor.create(V, seeding_scheme="lefthash", precompute_greenlists=True))
    everything.append(WatermarkLogitsProcessor.create(V, seeding_scheme="selfhash", context_width=2))
    chain = ProcessorChain(tuple(p for p in everything if p.compile_safe))
    assert len(chain) == len(everything)
    compiled = torch.compile(lambda x, c: chain(x, c), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(logits, ctx), chain(logits, ctx), atol=0, rtol=0, equal_nan=True)
    # The per-row chain, with [B] lengths, traces too and computes the same.
    rows = chain.per_row(logits.shape[0])
    rows_ctx = ctx.replace(cur_len=ctx.row_cur_len().clone(), prompt_len=ctx.row_prompt_len().clone())
    compiled_rows = torch.compile(lambda x, c, ch: ch(x, c), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled_rows(logits, rows_ctx, rows), chain(logits, ctx), atol=0, rtol=0,
                               equal_nan=True)


# ---------------------------------------------------------------------------------------------
# watermarking (green lists)


WM_V = 64


@pytest.mark.parametrize("scheme,width", [("lefthash", 1), ("lefthash", 3), ("selfhash", 1), ("selfhash", 3)])
def test_watermark_matches_transformers(scheme, width):
    theirs = hf.WatermarkLogitsProcessor(
        WM_V, "cpu", greenlist_ratio=0.25, bias=2.0, seeding_scheme=scheme, context_width=width
    )
    ours = WatermarkLogitsProcessor.create(
        WM_V, greenlist_ratio=0.25, bias=2.0, seeding_scheme=scheme, context_width=width
    )
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, WM_V, (3, 12), generator=g)
    logits = torch.randn((3, WM_V), generator=g)
    for cur_len in (width - 1, width, 9):
        if cur_len < 1:
            continue
        ctx = LogitsContext(tokens=tokens, cur_len=torch.tensor(cur_len), prompt_len=torch.tensor(1))
        torch.testing.assert_close(ours(logits, ctx), theirs(tokens[:, :cur_len], logits.clone()), atol=0, rtol=0)
    if scheme == "lefthash":
        for t in (0, 5, WM_V - 1):
            want = theirs._get_greenlist_ids(torch.tensor([t]))
            assert torch.equal(greenlist_ids(ours.hashing_key * t, WM_V, ours.greenlist_size), want)


def _greedy_decode(processor, steps: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros((2, steps + 1), dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, WM_V, (2,), generator=g)
    for t in range(1, steps + 1):
        logits = torch.randn((2, WM_V), generator=g)
        if processor is not None:
            ctx = LogitsContext(tokens=tokens, cur_len=torch.tensor(t), prompt_len=torch.tensor(1))
            logits = processor(logits, ctx)
        tokens[:, t] = logits.argmax(-1)
    return tokens


@pytest.mark.parametrize("scheme", ["lefthash", "selfhash"])
def test_watermark_detector(scheme):
    from transformers import LlamaConfig
    from transformers.generation.watermarking import WatermarkDetector as HFDetector

    processor = WatermarkLogitsProcessor.create(WM_V, seeding_scheme=scheme)
    marked = _greedy_decode(processor, 60, seed=0)
    plain = _greedy_decode(None, 60, seed=1)
    ours = WatermarkDetector(WM_V, bos_token_id=None, seeding_scheme=scheme)
    out_marked = ours(marked, return_dict=True)
    out_plain = ours(plain, return_dict=True)
    assert (out_marked.z_score > 5).all() and out_marked.prediction.all()
    assert (out_plain.z_score.abs() < 3).all() and not out_plain.prediction.any()

    bos = WM_V - 1
    model_config = LlamaConfig(vocab_size=WM_V, bos_token_id=bos)
    settings = {
        "seeding_scheme": scheme,
        "greenlist_ratio": 0.25,
        "bias": 2.0,
        "hashing_key": 15485863,
        "context_width": 1,
    }
    for ignore in (False, True):
        theirs = HFDetector(model_config, "cpu", settings, ignore_repeated_ngrams=ignore)
        mine = WatermarkDetector.from_config(WM_V, settings, bos_token_id=bos, ignore_repeated_ngrams=ignore)
        with_bos = torch.cat([torch.full((2, 1), bos), marked], dim=1)
        for ids in (marked[:, 1:], plain[:, 1:], with_bos):
            want, got = theirs(ids, return_dict=True), mine(ids, return_dict=True)
            torch.testing.assert_close(got.z_score, torch.as_tensor(want.z_score), atol=1e-9, rtol=0)
            torch.testing.assert_close(got.p_value, torch.as_tensor(want.p_value), atol=1e-9, rtol=0)
            assert torch.equal(got.num_green_tokens, torch.as_tensor(want.num_green_tokens))


def test_watermark_from_config_in_chain_uses_vocab_size():
    config = transformers_config(4, [3], watermarking_config={"bias": 2.0})
    with pytest.raises(ValueError, match="vocab_size"):
        build_logits_processors(config, prompt_len=4, max_length=24, min_length=0, eos_token_ids=[3])


# ---------------------------------------------------------------------------------------------
# SynthID


SYNTH = dict(
    ngram_len=3,
    keys=[654, 400, 836, 123, 340, 443, 597, 160],
    sampling_table_size=2**10,
    sampling_table_seed=0,
    context_history_size=6,
)


@pytest.mark.parametrize("skip_first,debug", [(False, False), (True, False), (False, True)])
def test_synthid_matches_transformers_over_steps(skip_first, debug):
    theirs = hf.SynthIDTextWatermarkLogitsProcessor(
        **SYNTH, device="cpu", skip_first_ngram_calls=skip_first, debug_mode=debug
    )
    ours = SynthIDTextWatermarkLogitsProcessor.create(**SYNTH, skip_first_ngram_calls=skip_first, debug_mode=debug)
    assert torch.equal(ours.sampling_table, theirs.sampling_table)
    g = torch.Generator().manual_seed(9)
    batch, prompt_len, steps = 3, 4, 12
    tokens = torch.randint(0, 5, (batch, prompt_len + steps), generator=g)  # small range: contexts repeat
    state = ours.init_state(batch)
    for t in range(prompt_len, prompt_len + steps):
        logits = torch.randn((batch, V), generator=g)
        ctx = LogitsContext(tokens=tokens, cur_len=torch.tensor(t), prompt_len=torch.tensor(prompt_len))
        got, state = ours.apply(logits.clone(), ctx, state)
        want = theirs(tokens[:, :t], logits.clone())
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert torch.equal(state.context, theirs.state.context)
        assert torch.equal(state.context_history, theirs.state.context_history)


def test_synthid_detection_pieces_and_mean_score():
    theirs = hf.SynthIDTextWatermarkLogitsProcessor(**SYNTH, device="cpu")
    ours = SynthIDTextWatermarkLogitsProcessor.create(**SYNTH)
    ids = torch.randint(0, 6, (3, 30), generator=torch.Generator().manual_seed(2))
    ids[1, 20] = 3
    assert torch.equal(ours.compute_g_values(ids), theirs.compute_g_values(ids))
    assert torch.equal(ours.compute_context_repetition_mask(ids), theirs.compute_context_repetition_mask(ids))
    assert torch.equal(ours.compute_eos_token_mask(ids, 3).bool(), theirs.compute_eos_token_mask(ids, 3).bool())

    # Greedy decoding under the watermark scores high; plain greedy decoding about 0.5.
    def decode(processor, seed):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.zeros((4, 80), dtype=torch.int64)
        tokens[:, :3] = torch.randint(0, V, (4, 3), generator=g)
        state = processor.init_state(4) if processor else None
        for t in range(3, 80):
            logits = torch.randn((4, V), generator=g)
            if processor:
                ctx = LogitsContext(tokens=tokens, cur_len=torch.tensor(t), prompt_len=torch.tensor(3))
                logits, state = processor.apply(logits, ctx, state)
            tokens[:, t] = logits.argmax(-1)
        return tokens

    detector = SynthIDTextWatermarkLogitsProcessor.create(**{**SYNTH, "context_history_size": 1024})
    for processor, low, high in ((detector, 0.62, 1.0), (None, 0.4, 0.6)):
        g_values, mask = detector.detection_inputs(decode(processor, 5), eos_token_id=None)
        score = synthid_mean_score(g_values.double(), mask.double())
        assert ((score > low) & (score < high)).all(), score


def test_synthid_chain_state_compiles():
    processor = SynthIDTextWatermarkLogitsProcessor.create(**SYNTH)
    chain = ProcessorChain((TopKLogitsWarper(20), processor))
    assert chain.stateful
    with pytest.raises(TypeError):
        chain(torch.zeros(1, V), make_batch(0, batch=1)[0])
    ctx, logits, _, _ = make_batch(4, batch=2)
    state = chain.init_state(2)
    compiled = torch.compile(lambda x, c, s: chain.apply(x, c, s), fullgraph=True, backend="eager")
    got, got_state = compiled(logits, ctx, state)
    want, want_state = chain.apply(logits, ctx, state)
    assert torch.equal(got, want)
    assert torch.equal(got_state[1].context_history, want_state[1].context_history)
