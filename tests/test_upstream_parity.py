"""The parity gaps transformers' own generation test files showed (run through
``benchmarks/upstream_parity.py``), each pinned here without those files or a network: the
``device=`` keyword of transformers' constructors, SynthID's ``_compute_keys`` over candidate ids,
StopStringCriteria's helpers that transformers' tests call, and the import shim itself."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
import transformers.generation as tg
import transformers.generation.stopping_criteria as tsc

import genfn
from genfn.bench import upstream_shim

REPO = Path(__file__).resolve().parents[1]

# transformers' constructors that take `device=` (5.24), with arguments in transformers' form.
WITH_DEVICE = {
    "MinLengthLogitsProcessor": dict(min_length=6, eos_token_id=[0, 3]),
    "MinNewTokensLengthLogitsProcessor": dict(prompt_length_to_skip=2, min_new_tokens=5, eos_token_id=0),
    "ForcedEOSTokenLogitsProcessor": dict(max_length=5, eos_token_id=0),
    "SuppressTokensLogitsProcessor": dict(suppress_tokens=[1, 4]),
    "SuppressTokensAtBeginLogitsProcessor": dict(begin_suppress_tokens=[1, 4], begin_index=4),
    "EtaLogitsWarper": dict(epsilon=0.1, min_tokens_to_keep=2),
}


@pytest.mark.parametrize("name", sorted(WITH_DEVICE))
def test_constructors_take_transformers_device_keyword(name):
    shimmed = upstream_shim.resolve(name)  # genfn's class, called transformers' way
    ours = shimmed(**WITH_DEVICE[name], device="cpu")
    theirs = getattr(tg, name)(**WITH_DEVICE[name], device="cpu")
    assert repr(ours.genfn_object) == repr(getattr(genfn, name)(**WITH_DEVICE[name]))  # the device is checked, not kept
    torch.manual_seed(0)
    scores = torch.randn(3, 11)
    input_ids = torch.randint(0, 11, (3, 4))
    torch.testing.assert_close(ours(input_ids, scores), theirs(input_ids, scores))
    with pytest.raises(RuntimeError):  # as transformers' constructor: torch refuses the name
        getattr(genfn, name)(**WITH_DEVICE[name], device="no-such-device")


def test_min_new_tokens_positional_arguments_mean_what_they_mean_in_transformers():
    # (prompt_length_to_skip, min_new_tokens, eos_token_id): a positional call ported from
    # transformers must not silently swap the skip and the minimum.
    ours = genfn.MinNewTokensLengthLogitsProcessor(2, 5, 0)
    theirs = tg.MinNewTokensLengthLogitsProcessor(2, 5, 0)
    assert (ours.prompt_length_to_skip, ours.min_new_tokens) == (theirs.prompt_length_to_skip, theirs.min_new_tokens)
    scores = torch.randn(1, 11)
    for length in range(2, 10):
        input_ids = torch.ones(1, length, dtype=torch.int64)
        torch.testing.assert_close(upstream_shim.resolve("MinNewTokensLengthLogitsProcessor")(2, 5, 0)(input_ids, scores),
                                   theirs(input_ids, scores))


def test_synthid_compute_keys_takes_candidate_ids_as_transformers():
    arguments = dict(ngram_len=4, keys=[3, 77, 1000], sampling_table_size=2**8, sampling_table_seed=0,
                     context_history_size=16, device="cpu")
    ours = genfn.SynthIDTextWatermarkLogitsProcessor(**arguments)
    theirs = tg.SynthIDTextWatermarkLogitsProcessor(**arguments)
    torch.manual_seed(0)
    context = torch.randint(0, 100, (3, 3))
    candidates = torch.randint(0, 1000, (3, 7))
    for got, expected in zip(ours._compute_keys(context, candidates), theirs._compute_keys(context, candidates)):
        assert torch.equal(got, expected)
    every = torch.arange(50).expand(3, 50)
    assert torch.equal(ours._compute_keys(context, 50)[0], theirs._compute_keys(context, every)[0])


@pytest.mark.parametrize("stops", [["stop"], ["stop", "op", "ast"]])
def test_stop_string_helpers_answer_as_transformers(stops):
    tokens, ids = ["last", "top", "topper", "s", "p", "xx", "ps"], [0, 1, 2, 3, 4, 6, 7]
    ours, theirs = genfn.StopStringCriteria, tsc.StopStringCriteria
    assert (ours._stop_string_get_matching_positions(tokens, ids, stops)
            == theirs._stop_string_get_matching_positions(tokens, ids, stops))
    got, expected = (c._stop_string_create_embedding_vec(tokens, ids, stops) for c in (ours, theirs))
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_stop_string_byte_helpers_answer_as_transformers():
    ours, theirs = genfn.StopStringCriteria, tsc.StopStringCriteria
    for token in ["<0xEB>", "<0xeb>", "<0x+1>", "<0xG1>", "<0x1>", "<0x100>", "hello"]:
        assert ours._token_to_bytes(token, "byte_fallback", None) == theirs._token_to_bytes(token, "byte_fallback", None)
    alphabet = {"a": 97, "Ġ": 32}
    for token in ["aĠa", "aé"]:
        assert ours._token_to_bytes(token, "byte_level", alphabet) == theirs._token_to_bytes(token, "byte_level", alphabet)

    class Decoder:  # a backend whose decoder only shows its JSON state, as transformers' test builds one
        def __init__(self, state):
            self.state = state

        def __getstate__(self):
            return self.state

    class Tokenizer:
        def __init__(self, state):
            self.backend_tokenizer = type("Backend", (), {"decoder": Decoder(state)})()

    for state in [b'{"type":"Sequence","decoders":[{"type":"ByteLevel"}]}',
                  b'{"type":"Sequence","decoders":[{"type":"ByteFallback"},{"type":"ByteLevel"}]}',
                  b'{"type":"Replace","content":"ByteFallback"}']:
        assert (ours._get_stop_string_matching_mode(Tokenizer(state))
                == theirs._get_stop_string_matching_mode(Tokenizer(state)))


def test_shim_calls_genfn_processors_the_transformers_way():
    torch.manual_seed(0)
    scores, input_ids = torch.randn(2, 13), torch.randint(0, 13, (2, 5))
    top_k = upstream_shim.resolve("TopKLogitsWarper")(3)
    torch.testing.assert_close(top_k(None, scores), tg.TopKLogitsWarper(3)(None, scores))
    assert top_k.top_k == 3  # public attributes read through
    chain = upstream_shim.resolve("LogitsProcessorList")([upstream_shim.resolve("RepetitionPenaltyLogitsProcessor")(1.5),
                                                         top_k])
    expected = tg.LogitsProcessorList([tg.RepetitionPenaltyLogitsProcessor(1.5), tg.TopKLogitsWarper(3)])
    torch.testing.assert_close(chain(input_ids, scores), expected(input_ids, scores))
    # Criteria already take transformers' arguments: handed out as they are.
    assert upstream_shim.resolve("MaxLengthCriteria") is genfn.MaxLengthCriteria
    # Test tools are transformers' own; a generation name genfn lacks fails only where it is used.
    import transformers
    assert upstream_shim.resolve("AutoTokenizer") is transformers.AutoTokenizer
    missing = upstream_shim.resolve("BarkEosPrioritizerLogitsProcessor")
    with pytest.raises(upstream_shim.NotInGenfn, match="Bark's audio generation"):
        missing(eos_token_id=2, min_eos_p=0.1)


def test_runner_rewrites_only_transformers_generation_imports():
    runner = runpy.run_path(str(REPO / "benchmarks" / "upstream_parity.py"), run_name="upstream_parity")
    source = ("from transformers import AutoTokenizer, is_torch_available\n"
              "from transformers.testing_utils import require_torch, torch_device\n"
              "    from transformers.generation import (\n        TopKLogitsWarper,\n    )\n"
              "    from transformers.generation.stopping_criteria import STOP_STRING_EMBEDDING_CACHE\n")
    rewritten = runner["rewrite_for_genfn"](source).splitlines()
    assert rewritten[0] == "from genfn.bench.upstream_shim import AutoTokenizer, is_torch_available"
    assert rewritten[1] == "from transformers.testing_utils import require_torch, torch_device"
    assert rewritten[2] == "    from genfn.bench.upstream_shim import ("
    assert rewritten[5] == "    from genfn.bench.upstream_shim import STOP_STRING_EMBEDDING_CACHE"
    theirs = {"f::a": ("passed", ""), "f::b": ("passed", ""), "f::c": ("failed", "OSError: offline")}
    ours = {"f::a": ("passed", ""), "f::b": ("failed", "TypeError: x"), "f::c": ("passed", "")}
    summary = runner["compare"](theirs, ours)
    assert (summary["transformers_passed"], summary["genfn_passed"]) == (2, 1)
    assert summary["categories"] == {"TypeError": 1} and summary["genfn_only_passed"] == ["f::c"]
