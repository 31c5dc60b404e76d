"""Logits processors end to end: generate on SmolLM2 under each processor returns transformers'
tokens and per-step processed scores; sampling under each truncation warper draws from exactly
the renormalized allowed set."""

from unittest import mock

import pytest
import torch

import genfn
from genfn import random as R
from genfn.config import GenerationConfig
from genfn.processors.chain import build_logits_processors
from genfn.state.decode import DecodeOptions, DecodeState
from genfn.strategies.sample import _choose_next

NEW = 8


@pytest.fixture(scope="module")
def batch(smollm2):
    enc = smollm2.tokenizer(["Write a haiku about the sea.", "The capital of France is"])
    return enc["input_ids"], enc["attention_mask"]


@pytest.fixture(scope="module")
def greedy(smollm2, batch):
    """The plain greedy continuation, to aim token-level processors at tokens that matter."""
    ids, mask = batch
    return genfn.generate(smollm2, ids, attention_mask=mask, max_new_tokens=NEW)[:, ids.shape[1]:].tolist()


def _assert_scores_equal(mine, theirs, atol=1e-4):
    assert len(mine) == len(theirs)
    for step, (a, b) in enumerate(zip(mine, theirs)):
        assert torch.equal(torch.isneginf(a), torch.isneginf(b)), f"step {step}: -inf in different places"
        assert torch.equal(torch.isposinf(a), torch.isposinf(b))
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite)
        # rtol: a length penalty grows scores to |x| * factor**i, where one float32 ulp of a logit
        # difference between the two models is above atol; and genfn's fused native decode layer
        # sums in another order than transformers' layer op by op, which moves every logit of a step
        # by up to a few ulps of the step's largest (~1e-5 of it: 1.1e-4 at a logit near 1 in a step
        # whose largest is ~30, on an Intel Xeon, where MKL's sums run in another order than on AMD).
        scale = b[finite].abs().max().item() if finite.any() else 0.0
        assert torch.allclose(a[finite], b[finite], atol=max(atol, 1e-5 * scale), rtol=1e-5), \
            f"step {step}: max diff {(a[finite] - b[finite]).abs().max()}"


def _run_both(smollm2, hf_smollm2, ids, mask, genfn_kwargs, hf_kwargs, sample=False):
    common = dict(attention_mask=mask, max_new_tokens=NEW, return_dict_in_generate=True, output_scores=True)
    out = genfn.generate(smollm2, ids, key=7 if sample else None, **common, **genfn_kwargs)
    with torch.no_grad():
        if not sample:
            ref = hf_smollm2.generate(input_ids=ids, do_sample=False, **common, **hf_kwargs)
        else:
            # transformers draws with torch.multinomial: make it draw genfn's tokens, so both
            # libraries process the same prefixes and their scores can be compared step by step.
            steps = iter(out.sequences[:, ids.shape[1]:].T)
            with mock.patch("torch.multinomial", lambda probs, num_samples=1, **kw: next(steps).unsqueeze(1)):
                ref = hf_smollm2.generate(input_ids=ids, **common, **hf_kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    _assert_scores_equal(out.scores, ref.scores)
    return out


# (name, settings from the greedy continuation g): the same settings go to both libraries.
GREEDY_CASES = [
    ("repetition_penalty", lambda g: dict(repetition_penalty=1.3)),
    ("no_repeat_ngram_size", lambda g: dict(no_repeat_ngram_size=1)),
    ("bad_words_ids", lambda g: dict(bad_words_ids=[[g[0][1]], [g[1][0], g[1][1]]])),
    ("sequence_bias", lambda g: dict(sequence_bias={(g[0][2],): -8.0, (g[1][0], g[1][1]): -6.0, (g[1][0],): 0.5})),
    ("suppress_tokens", lambda g: dict(suppress_tokens=[g[0][0], g[1][2]])),
    ("begin_suppress_tokens", lambda g: dict(begin_suppress_tokens=[g[0][0], g[1][0]])),
    ("forced_eos_token_id", lambda g: dict(forced_eos_token_id=13)),
    ("min_new_tokens", lambda g: dict(min_new_tokens=6)),
    ("exponential_decay_length_penalty", lambda g: dict(exponential_decay_length_penalty=(2, 1.5))),
    ("renormalize_logits", lambda g: dict(renormalize_logits=True, repetition_penalty=1.2)),
    ("encoder_repetition_penalty", lambda g: dict(encoder_repetition_penalty=1.5)),
    ("encoder_no_repeat_ngram_size", lambda g: dict(encoder_no_repeat_ngram_size=2)),
    # inf/nan removal turns the -inf of the EOS ban into the float32 minimum.
    ("remove_invalid_values", lambda g: dict(remove_invalid_values=True, min_new_tokens=4)),
]
CHANGES_OUTPUT = ("bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "no_repeat_ngram_size",
                  "repetition_penalty", "sequence_bias")
BANS_EOS = {"min_new_tokens": float("-inf"), "remove_invalid_values": torch.finfo(torch.float32).min}


@pytest.mark.parametrize("name,settings", GREEDY_CASES, ids=[c[0] for c in GREEDY_CASES])
def test_greedy_processor_matches_transformers(smollm2, hf_smollm2, batch, greedy, name, settings):
    ids, mask = batch
    kwargs = settings(greedy)
    out = _run_both(smollm2, hf_smollm2, ids, mask, kwargs, kwargs)
    if name in CHANGES_OUTPUT:
        assert out.sequences[:, ids.shape[1]:].tolist() != greedy, "the setting should change the output"
    if name in BANS_EOS:
        assert (out.scores[0][:, smollm2.generation_config.eos_token_id] == BANS_EOS[name]).all()


def test_forced_bos_matches_transformers(smollm2, hf_smollm2):
    ids = torch.tensor([[504], [2795]])  # one-token prompts: the first new token is forced
    out = _run_both(smollm2, hf_smollm2, ids, torch.ones_like(ids), dict(forced_bos_token_id=28),
                    dict(forced_bos_token_id=28))
    assert (out.sequences[:, 1] == 28).all()


def test_watermark_processors_match_transformers(smollm2, hf_smollm2, batch):
    import transformers

    ids, mask = batch
    _run_both(smollm2, hf_smollm2, ids, mask, dict(watermarking_config=genfn.WatermarkingConfig(bias=4.0)),
              dict(watermarking_config=transformers.WatermarkingConfig(bias=4.0)))
    keys = [654, 400, 836, 123, 340, 443]
    _run_both(smollm2, hf_smollm2, ids, mask,
              dict(watermarking_config=genfn.SynthIDTextWatermarkingConfig(ngram_len=3, keys=keys)),
              dict(watermarking_config=transformers.SynthIDTextWatermarkingConfig(ngram_len=3, keys=keys)))


SAMPLE_CASES = [
    ("temperature", dict(temperature=0.7)),
    ("top_k", dict(top_k=10)),
    ("top_p", dict(top_p=0.8)),
    ("min_p", dict(min_p=0.1)),
    ("typical_p", dict(typical_p=0.8)),
    ("epsilon_cutoff", dict(epsilon_cutoff=3e-4)),
    ("eta_cutoff", dict(eta_cutoff=1e-3)),
    ("top_h", dict(top_h=0.4)),
    ("stacked", dict(temperature=1.3, top_k=30, top_p=0.95, min_p=0.02, repetition_penalty=1.2)),
]


@pytest.mark.parametrize("name,settings", SAMPLE_CASES, ids=[c[0] for c in SAMPLE_CASES])
def test_sampling_warper_scores_match_transformers(smollm2, hf_smollm2, batch, name, settings):
    ids, mask = batch
    _run_both(smollm2, hf_smollm2, ids, mask, dict(do_sample=True, **settings), dict(do_sample=True, **settings),
              sample=True)


# ---- sampling distribution under each truncation warper ------------------------------------------

LOGITS = torch.tensor([[2.2, -0.4, 1.7, 0.9, -2.5, 1.2, 0.3, -1.1, 0.6, 2.0, -0.2, -3.5]])
TRUNCATIONS = [
    ("top_k", dict(top_k=4)),
    ("top_p", dict(top_p=0.7)),
    ("min_p", dict(min_p=0.15)),
    ("typical_p", dict(typical_p=0.6)),
    ("epsilon_cutoff", dict(epsilon_cutoff=0.05)),
    ("eta_cutoff", dict(eta_cutoff=0.1)),
    ("top_h", dict(top_h=0.5)),
]


def _hf_warper(name, value):
    from transformers.generation import logits_process as lp

    cls = {"top_k": lp.TopKLogitsWarper, "top_p": lp.TopPLogitsWarper, "min_p": lp.MinPLogitsWarper,
           "typical_p": lp.TypicalLogitsWarper, "epsilon_cutoff": lp.EpsilonLogitsWarper,
           "eta_cutoff": lp.EtaLogitsWarper, "top_h": lp.TopHLogitsWarper}[name]
    return cls(value)


def _draw(chain, n: int) -> torch.Tensor:
    """``n`` draws from ``LOGITS`` with genfn's real sampling step (one key per row), the chain in
    its per-row form (every number a [n] leaf, as a compiled step carries it)."""
    vocab = LOGITS.shape[-1]
    options = DecodeOptions(do_sample=True, pad_token_id=0, eos_token_ids=())
    rows = torch.ones(n, dtype=torch.int64)
    state = DecodeState(tokens=torch.zeros(n, 4, dtype=torch.int64), cur_len=rows, prompt_len=rows,
                        max_length=4 * rows, positions=torch.zeros(n, dtype=torch.int64),
                        done=torch.zeros(n, dtype=torch.bool), keys=R.split(R.key(2024), n), cache=None,
                        scores=None, logits=None, nonfinite=torch.zeros(n, dtype=torch.bool), options=options,
                        processors=chain.per_row(n))
    return _choose_next(state, LOGITS.expand(n, vocab)).tokens[:, 1]


@pytest.mark.parametrize("name,settings", TRUNCATIONS, ids=[t[0] for t in TRUNCATIONS])
def test_truncation_sampling_distribution(name, settings):
    config = GenerationConfig(do_sample=True, **{"top_k": 0, **settings})
    chain = build_logits_processors(config, prompt_len=1, max_length=4, min_length=0, eos_token_ids=[])
    assert len(chain) == 1
    # The oracle: transformers' warper on the same logits, renormalized.
    allowed_scores = _hf_warper(name, next(iter(settings.values())))(None, LOGITS.clone())
    probs = torch.softmax(allowed_scores[0].double(), -1)
    allowed = probs > 0
    assert 1 < int(allowed.sum()) < LOGITS.shape[-1], "the setting should truncate, and keep a choice"
    n = 30_000
    draws = _draw(chain, n)
    counts = torch.bincount(draws, minlength=LOGITS.shape[-1]).double()
    assert counts[~allowed].sum() == 0, "drew a token the warper removes"
    expected = probs[allowed] * n
    chi2 = float(((counts[allowed] - expected) ** 2 / expected).sum())
    dof = int(allowed.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))
    assert p_value > 1e-3, f"chi2={chi2:.1f} at {dof} dof (p={p_value:.2g})"


def test_transformers_processor_objects_in_logits_processor(smollm2, hf_smollm2, batch, greedy):
    """transformers' own processors (and plain callables) passed to genfn.generate run as they do
    in transformers.generate: same tokens, same scores."""
    from transformers import LogitsProcessorList, SuppressTokensLogitsProcessor

    ids, mask = batch
    suppressed = [greedy[0][0], greedy[1][1]]

    def damp_first_tokens(input_ids, scores):
        return scores - 5.0 * (torch.arange(scores.shape[-1]) < 100)

    def processors():
        return LogitsProcessorList([SuppressTokensLogitsProcessor(suppressed, device="cpu"), damp_first_tokens])

    out = _run_both(smollm2, hf_smollm2, ids, mask, dict(logits_processor=processors()),
                    dict(logits_processor=processors()))
    assert out.sequences[:, ids.shape[1]:].tolist() != greedy, "the processors should change the output"


def test_bad_words_of_only_eos_is_a_no_op(smollm2, hf_smollm2, batch, greedy):
    ids, mask = batch
    eos = smollm2.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    out = _run_both(smollm2, hf_smollm2, ids, mask, dict(bad_words_ids=[[e] for e in eos]),
                    dict(bad_words_ids=[[e] for e in eos]))
    assert out.sequences[:, ids.shape[1]:].tolist() == greedy
