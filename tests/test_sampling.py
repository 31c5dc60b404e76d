"""Sampling: reproducible per key, independent of batch composition, and from the right distribution."""

import pytest
import torch

import genfn
from conftest import tiny_pair
from genfn import random as R
from genfn.state.decode import DecodeOptions
from genfn.strategies.sample import _choose_next


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair(eos_token_id=None)[1]


def test_same_key_same_tokens_different_key_different_tokens(tiny):
    ids = torch.tensor([[7, 8, 9, 10]])
    a = genfn.generate(tiny, ids, do_sample=True, max_new_tokens=20, key=genfn.random.key(1))
    b = genfn.generate(tiny, ids, do_sample=True, max_new_tokens=20, key=genfn.random.key(1))
    c = genfn.generate(tiny, ids, do_sample=True, max_new_tokens=20, key=genfn.random.key(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a, genfn.generate(tiny, ids, do_sample=True, max_new_tokens=20, key=1))


def test_row_tokens_do_not_change_when_rows_are_added(tiny):
    """A row keeps its tokens alone or batched (with more left padding), given its own key."""
    keys = R.split(R.key(42), 3)
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25, 26], [31, 32]]
    alone = [genfn.generate(tiny, torch.tensor([p]), do_sample=True, max_new_tokens=15, key=keys[i:i + 1],
                            top_k=0, temperature=0.9)[0, len(p):]
             for i, p in enumerate(prompts)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    batched = genfn.generate(tiny, ids, attention_mask=mask, do_sample=True, max_new_tokens=15, key=keys,
                             top_k=0, temperature=0.9)
    for i in range(3):
        assert torch.equal(batched[i, width:], alone[i])


def _sample_many(logits: torch.Tensor, n: int, processors=None) -> torch.Tensor:
    """Draw ``n`` tokens from one row of logits with the real sampling step (n independent keys)."""
    from genfn.state.decode import DecodeState

    vocab = logits.shape[-1]
    options = DecodeOptions(do_sample=True, pad_token_id=0, eos_token_ids=())
    ones = torch.ones(n, dtype=torch.int64)
    state = DecodeState(tokens=torch.zeros(n, 4, dtype=torch.int64), cur_len=ones, prompt_len=ones.clone(),
                        max_length=4 * ones, positions=torch.zeros(n, dtype=torch.int64),
                        done=torch.zeros(n, dtype=torch.bool), keys=R.split(R.key(123), n), cache=None, scores=None,
                        logits=None, nonfinite=torch.zeros(n, dtype=torch.bool), options=options,
                        processors=processors)
    return _choose_next(state, logits.expand(n, vocab)).tokens[:, 1]


def _chi_square(draws: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    expected = probs.double() * draws.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability zero"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum()) - 1


def test_sampler_draws_from_softmax_over_temperature():
    from genfn.processors.warpers import TemperatureLogitsWarper

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2]])
    temperature = 0.7
    draws = _sample_many(logits, 40_000, processors=TemperatureLogitsWarper(temperature))
    chi2, dof = _chi_square(draws, torch.softmax(logits[0] / temperature, -1))
    assert chi2 < 24.3, f"chi2={chi2} with {dof} dof"  # p = 0.001 at 7 dof


def test_sampling_compiled_equals_eager(tiny):
    ids = torch.tensor([[7, 8, 9, 10]])
    kwargs = dict(do_sample=True, max_new_tokens=12, key=genfn.random.key(9), temperature=0.8, top_k=20, top_p=0.9,
                  repetition_penalty=1.2, min_p=0.05, max_cache_len=32)
    eager = genfn.generate(tiny, ids, **kwargs)
    compiled = genfn.generate(tiny, ids, cache_implementation="static", **kwargs)
    assert torch.equal(eager, compiled)
