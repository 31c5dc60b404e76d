"""The determinism report: its comparison arithmetic, its structure on a tiny model, that it finds a
variant known to differ at the right token, and the `genfn determinism` command's JSON."""

from __future__ import annotations

import json
import random

import pytest
import torch

from cli_support import build_tiny_model
from conftest import tiny_hf_model
from genfn import cli
from genfn.determinism import RequestRun, check, compare, run_generate
from genfn.generation import generate
from genfn.models.model import from_hf_state_dict
from test_decode_layer import needs_vnni
from test_paged_native import needs_kernel

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def models():
    """The tiny Llama and a copy whose LM head carries a little noise (a variant that differs)."""
    hf_model, config = tiny_hf_model()
    state = hf_model.state_dict()
    noisy = dict(state)
    generator = torch.Generator().manual_seed(1)
    noisy["lm_head.weight"] = state["lm_head.weight"] + 0.01 * torch.randn(state["lm_head.weight"].shape,
                                                                           generator=generator)
    return from_hf_state_dict(config, state), from_hf_state_dict(config, noisy)


def _prompts(count=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 97) for _ in range(rng.randint(1, 20))] for _ in range(count)]


def test_compare_finds_the_first_divergent_token_and_the_largest_differences():
    reference = [RequestRun([5, 6, 7], [-0.1, -0.2, -0.3], [1.0, 2.0, 3.0]),
                 RequestRun([5, 6, 7, 2], [-0.1, -0.2, -0.3, -0.4], [1.0, 2.0, 3.0, 4.0])]
    variant = [RequestRun([5, 6, 7], [-0.1, -0.25, -0.3], [1.0, 2.5, 3.0]),
               RequestRun([5, 6, 9], [-0.1, -0.2, -1.3], [1.0, 2.0, 9.0])]
    comp = compare(reference, variant, "a", "b")
    assert (comp.identical, comp.total, comp.identical_share) == (1, 2, 0.5)
    assert [(d.request, d.first_token) for d in comp.divergences] == [(1, 2)]
    # Differences only over the tokens chosen alike (request 1's third token is another token).
    assert comp.max_logprob_diff == pytest.approx(0.05)
    assert comp.max_logit_diff == pytest.approx(0.5)
    # A run that stops early (EOS) diverges where the shorter one ends.
    short = compare([RequestRun([5, 6], [0.0, 0.0])], [RequestRun([5, 6, 2], [0.0, 0.0, 0.0])])
    assert [d.first_token for d in short.divergences] == [2] and short.max_logit_diff is None


@pytest.mark.parametrize("do_sample", [False, True])
def test_report_finds_a_perturbed_model_at_its_first_divergent_token(models, do_sample):
    model, noisy = models
    prompts = _prompts()
    report = check(model, prompts, max_new_tokens=10, do_sample=do_sample, seed=3, batch_sizes=(3,),
                   continuous=False, threads=(1,),
                   variants={"again": lambda ids, seeds, s: run_generate(model, ids, seeds, s),
                             "noisy": lambda ids, seeds, s: run_generate(noisy, ids, seeds, s)})
    assert [c.variant for c in report.comparisons] == ["generate batch 3", "generate batch 3, shuffled",
                                                       "alone, 1 thread", "again", "noisy"]
    for comp in report.comparisons:
        assert comp.reference == "alone" and comp.total == len(prompts)
        assert comp.identical + len(comp.divergences) == comp.total
    again = report.comparison("again")
    assert again.identical == len(prompts) and again.max_logprob_diff == 0.0 and again.max_logit_diff == 0.0
    # The expected divergences, from plain generate calls with the same per-request keys.
    expected = []
    for i, prompt in enumerate(prompts):
        keys = {"key": 3 + i} if do_sample else {}
        rows = [generate(m, torch.tensor([prompt]), max_new_tokens=10, do_sample=do_sample, **keys)[0, len(prompt):]
                .tolist() for m in (model, noisy)]
        rows = [r[:r.index(2) + 1] if 2 in r else r for r in rows]
        if rows[0] != rows[1]:
            first = next((t for t, (a, b) in enumerate(zip(*rows)) if a != b), min(map(len, rows)))
            expected.append((i, first))
        assert report.runs["alone"][i].tokens == rows[0]
    found = report.comparison("noisy")
    assert expected and any(first > 0 for _, first in expected), "the perturbation proves nothing here"
    assert [(d.request, d.first_token) for d in found.divergences] == expected
    assert found.max_logprob_diff > 0
    table = report.format()
    assert "noisy" in table and f"{found.identical}/{len(prompts)}" in table


def test_continuous_variants_and_thread_counts_are_reported(models):
    model, _ = models
    ended = []
    report = check(model, _prompts(4, seed=1), max_new_tokens=6, do_sample=True, batch_sizes=(),
                   chunk_tokens=8, threads=(1, 2),
                   progress=lambda name, seconds, comparison: ended.append((name, seconds, comparison)))
    assert [(name, seconds) for name, seconds, _ in ended] == list(report.seconds.items())
    assert [comparison for _, _, comparison in ended] == [None, *report.comparisons]
    assert [c.variant for c in report.comparisons] == ["continuous, chunked prefill", "continuous, whole prompts",
                                                       "continuous, prefix cache", "alone, 1 thread",
                                                       "alone, 2 threads"]
    assert torch.get_num_threads() == 1  # restored (the module runs on one thread)
    for name in ("continuous, chunked prefill", "continuous, whole prompts", "continuous, prefix cache"):
        assert report.comparison(name).max_logit_diff is None  # the manager reports logprobs only
        assert all(len(run.logprobs) == len(run.tokens) for run in report.runs[name])
    json.dumps(report.to_dict())


def test_continuous_sizes_and_side_batches_in_the_mode_are_named_counted_and_bitwise_equal(models):
    model, _ = models
    prompts = [p + [7] * 6 for p in _prompts(5, seed=2)]  # every prompt fills a page of 4: the cache hits
    report = check(model, prompts, max_new_tokens=5, do_sample=True, batch_sizes=(), continuous_sizes=(4, 2, 4),
                   chunk_tokens=5, threads=(1,), side_batch_size=3, batch_invariant=True)
    assert [c.variant for c in report.comparisons] == [
        "continuous 2, chunked prefill", "continuous 2, whole prompts", "continuous 4, chunked prefill",
        "continuous 4, whole prompts", "continuous 4, prefix cache", "generate batch 3, 1 thread"]
    # The second round takes every prompt's full pages but the one holding its last token (computed
    # for its logits); the first round's hits count too.
    assert report.reused_tokens >= sum((len(p) - 1) // 4 * 4 for p in prompts)
    assert "prompt tokens reused" in report.format() and report.to_dict()["reused_tokens"] == report.reused_tokens
    assert report.to_dict()["generated_tokens"]["alone"] == sum(len(run.tokens) for run in report.runs["alone"]) > 0
    for comp in report.comparisons:
        assert (comp.identical, comp.max_logprob_diff) == (len(prompts), 0.0), comp.variant


def test_bad_arguments_raise_clear_errors(models):
    model, _ = models
    with pytest.raises(ValueError, match="max_new_tokens"):
        check(model, [[5]], max_new_tokens=0)
    with pytest.raises(ValueError, match="batch_sizes"):
        check(model, [[5]], batch_sizes=(0,))
    with pytest.raises(TypeError, match="prefix_cache"):
        check(model, [[5]], prefix_cache=1)
    with pytest.raises(ValueError, match="continuous_sizes must hold at least one"):
        check(model, [[5]], continuous_sizes=())
    with pytest.raises(ValueError, match="continuous_sizes must hold positive ints"):
        check(model, [[5]], continuous_sizes=(8, 0))
    with pytest.raises(TypeError, match="threads must be a sequence"):
        check(model, [[5]], threads=2)
    with pytest.raises(ValueError, match="side_batch_size` must be an int >= 1"):
        check(model, [[5]], side_batch_size=0)
    with pytest.raises(TypeError, match="prompts"):
        check(model, "a prompt")
    with pytest.raises(ValueError, match="at least one token"):
        check(model, [[]])
    with pytest.raises(ValueError, match="taken"):
        check(model, [[5]], variants={"alone": lambda *a: []})


def test_cli_prints_the_report_as_json(tmp_path, capsys):
    model_dir = build_tiny_model(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\n\nSay hi\nParis\n")
    assert cli.main(["determinism", "--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "4",
                     "--batch-sizes", "2", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["prompts"] == 3 and out["settings"]["max_new_tokens"] == 4
    names = [c["variant"] for c in out["comparisons"]]
    assert names[:2] == ["generate batch 2", "generate batch 2, shuffled"] and "continuous, chunked prefill" in names
    assert all(c["total"] == 3 and 0 <= c["identical_share"] <= 1 for c in out["comparisons"])
    assert cli.main(["determinism", "--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "3",
                     "--batch-sizes", "2", "--cb-sizes", "2", "--threads", "1", "--side-batch-size", "2",
                     "--no-prefix-cache", "--json", "--quiet"]) == 0
    names = [c["variant"] for c in json.loads(capsys.readouterr().out)["comparisons"]]
    assert names == ["generate batch 2", "generate batch 2, shuffled", "continuous 2, chunked prefill",
                     "continuous 2, whole prompts", "generate batch 2, 1 thread"]
    for flag, value in (("--batch-sizes", "0,x"), ("--cb-sizes", "8,-1"), ("--threads", "")):
        assert cli.main(["determinism", "--model", str(model_dir), flag, value]) == 2
        assert f"{flag} must be positive integers" in capsys.readouterr().err


@needs_kernel
@needs_vnni
def test_block_quantized_requests_keep_their_bits_in_every_batch_and_however_their_prompt_is_cut():
    """Q4_1 blocks (activations rounded to 8 bits, so one differing bit flips a rounding): each
    request's tokens and logprobs are those it gets alone, bit for bit, in left-padded generate
    batches, in continuous batching with its prompt whole or cut into 6-token chunks, and with its
    prompt's pages from the prefix cache, outside the batch-invariant mode. Prompts of 3 to 40
    tokens, on both sides of the prefill kernel's MIN_PREFILL_QUERIES: a short one padded beside a
    long one is walked as alone, a long one cut into chunks takes the prefill kernel as alone."""
    from conftest import tiny_pair
    from genfn.kernels import MIN_PREFILL_QUERIES
    from genfn.models.model import Model
    from genfn.models.quantized import quantize_params

    # head_dim 64, SmolLM2's: with 16 the prefill kernel's sums happened to equal the walk's.
    _, model = tiny_pair(seed=11, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    model = Model(model.spec, quantize_params(model.params, "q4_1"), model.apply_fn, model.init_cache_fn)
    rng = random.Random(5)
    lengths = [3, 9, 16, 17, 23, 40]
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in lengths]
    assert min(lengths) < MIN_PREFILL_QUERIES <= max(lengths)
    report = check(model, prompts, max_new_tokens=8, batch_sizes=(3, 6), chunk_tokens=6, threads=(1,))
    assert report.reused_tokens
    for comp in report.comparisons:
        assert (comp.identical, comp.max_logprob_diff) == (len(prompts), 0.0), comp.variant
