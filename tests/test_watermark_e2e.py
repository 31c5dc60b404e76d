"""Watermarking end to end on SmolLM2: the detectors tell watermarked samples from plain ones, and
a key reproduces its watermarked text."""

import pytest
import torch

import genfn
from genfn.processors.synthid import SynthIDTextWatermarkLogitsProcessor, synthid_mean_score
from genfn.processors.watermark import WatermarkDetector

TEXTS = ["The weather today", "My favorite food is", "Once upon a time", "The best way to learn", "In the year 2050",
         "Scientists have discovered", "The history of Rome", "A good friend is", "The ocean is", "Music makes me",
         "The city at night", "Learning to code", "The mountain trail", "My grandmother used to",
         "The future of energy", "A cup of coffee", "The old library", "Travel teaches us", "The garden in spring",
         "Artificial intelligence will"]
NEW = 20


@pytest.fixture(scope="module")
def prompts(smollm2):
    enc = smollm2.tokenizer(TEXTS)
    return enc["input_ids"], enc["attention_mask"]


def _sample(model, ids, mask, **kwargs):
    # min_new_tokens keeps EOS out, so every row has NEW scored tokens.
    return genfn.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True,
                          key=5, **kwargs)


@pytest.fixture(scope="module")
def plain(smollm2, prompts):
    return _sample(smollm2, *prompts)


def test_green_list_watermark_is_detected_and_reproducible(smollm2, prompts, plain):
    ids, mask = prompts
    config = genfn.WatermarkingConfig()
    marked = _sample(smollm2, ids, mask, watermarking_config=config)
    start = ids.shape[1] - 1  # score the new tokens, seeded from the last prompt token on
    detector = WatermarkDetector.from_config(smollm2.vocab_size, config)
    z_marked = detector(marked[:, start:], return_dict=True).z_score
    z_plain = detector(plain[:, start:], return_dict=True).z_score
    # 20 tokens at bias 2: watermarked rows sit near z = 4, plain ones near 0.
    assert z_marked.mean() - z_plain.mean() > 2.5
    assert (z_marked > 2).double().mean() >= 0.8 and (z_plain < 2).double().mean() >= 0.8
    assert (z_marked[:, None] > z_plain[None, :]).double().mean() > 0.95
    # Same key, same watermarked text; here for a sub-batch (less left padding), whose rows keep
    # their keys (row i uses fold_in(key, i)) and so their tokens.
    sub = smollm2.tokenizer(TEXTS[:3])
    sub_ids, sub_mask = sub["input_ids"], sub["attention_mask"]
    again = _sample(smollm2, sub_ids, sub_mask, watermarking_config=config)
    assert torch.equal(again[:, sub_ids.shape[1]:], marked[:3, ids.shape[1]:])


def test_synthid_mean_score_is_higher_on_watermarked_text(smollm2, prompts, plain):
    ids, mask = prompts
    rows = 10
    config = genfn.SynthIDTextWatermarkingConfig(ngram_len=4, keys=[654, 400, 836, 123, 340, 443, 597, 160])
    marked = _sample(smollm2, ids[:rows], mask[:rows], watermarking_config=config)
    processor = SynthIDTextWatermarkLogitsProcessor.from_config(config)
    start = ids.shape[1] - (config.ngram_len - 1)  # the first scored n-gram ends at the first new token

    def score(seq):
        g_values, scored = processor.detection_inputs(seq[:, start:], None)
        return synthid_mean_score(g_values, scored)

    marked_score, plain_score = score(marked), score(plain[:rows])
    assert marked_score.mean() > plain_score.mean() + 0.08
    assert (marked_score > 0.55).all() and abs(float(plain_score.mean()) - 0.5) < 0.05
