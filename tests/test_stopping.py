"""Stop strings: the tensorized matcher equals transformers' StopStringCriteria, and generate stops
right after a stop string, as transformers' generate does."""

import pytest
import torch

import genfn
from genfn.stopping import StopStringMatcher, stop_string_matching_mode
from hf_tokenizer import hf_smollm2_tokenizer


def _related_ids(matcher: StopStringMatcher) -> torch.Tensor:
    """Token ids that can take part in a match (valid position or end overlap for some string)."""
    has_pos = (matcher.positions[:-1] >= 0).flatten(1).any(1)
    has_end = (matcher.end_lengths[:-1] >= 0).flatten(1).any(1)
    return torch.nonzero(has_pos | has_end).flatten()


def _piece_ids(tokenizer, stops) -> torch.Tensor:
    """Ids of the tokens of every way the tokenizer splits short pieces of the stop strings."""
    pieces = set()
    for s in stops:
        for i in range(len(s)):
            for j in range(i + 1, len(s) + 1):
                pieces.update(tokenizer.encode(s[i:j], add_special_tokens=False))
                pieces.update(tokenizer.encode("x" + s[i:j], add_special_tokens=False))
    return torch.tensor(sorted(pieces))


@pytest.mark.parametrize("stops", [
    ["stop"],
    ["\n\n", "end.", "ab"],
    [" Texas", "é!", "x"],
    ["</s>", "Paris"],
])
def test_matcher_equals_transformers_on_random_sequences(smollm2, stops):
    from transformers.generation.stopping_criteria import StopStringCriteria

    tok = smollm2.tokenizer
    hf_tok = hf_smollm2_tokenizer()
    assert stop_string_matching_mode(tok) == "byte_level"
    matcher = StopStringMatcher.from_tokenizer(tok, stops)
    reference = StopStringCriteria(hf_tok, stops)
    gen = torch.Generator().manual_seed(len("".join(stops)))
    related, pieces = _related_ids(matcher), _piece_ids(tok, stops)
    rows, length = 2000, matcher.window + 3
    ids = torch.where(torch.rand(rows, length, generator=gen) < 0.5,
                      pieces[torch.randint(len(pieces), (rows, length), generator=gen)],
                      related[torch.randint(len(related), (rows, length), generator=gen)])
    ids = torch.where(torch.rand(rows, length, generator=gen) < 0.1,
                      torch.randint(smollm2.vocab_size, (rows, length), generator=gen), ids)
    # The buffer holds garbage past cur_len, which the matcher must not read.
    buffer = torch.cat([ids, torch.randint(smollm2.vocab_size, (rows, 4), generator=gen)], dim=1)
    hits = 0
    for cur_len in range(1, length + 1):
        expected = reference(ids[:, :cur_len], None)
        got = matcher(buffer, torch.tensor(cur_len))
        assert torch.equal(got, expected), f"cur_len={cur_len}: {(got != expected).sum()} rows differ"
        hits += int(expected.sum())
    assert hits > 100, "the random sequences should hit the stop strings often"
    # Rows of one batch at different lengths (the per-row contract): each row as if it were alone.
    per_row = torch.randint(1, length + 1, (rows,), generator=gen)
    expected = torch.zeros(rows, dtype=torch.bool)
    for cur_len in range(1, length + 1):
        members = per_row == cur_len
        expected[members] = reference(ids[members, :cur_len], None)
    assert torch.equal(matcher(buffer, per_row), expected)
    assert expected.any() and not expected.all()


def test_matcher_catches_a_string_split_across_tokens(smollm2):
    tok = smollm2.tokenizer
    matcher = StopStringMatcher.from_tokenizer(tok, ["stop"])
    ids = tok.convert_tokens_to_ids

    def hit(tokens):
        buffer = torch.tensor([ids(tokens) + [0, 0]])
        return bool(matcher(buffer, torch.tensor(len(tokens)))[0])

    assert hit(["st", "op"]) and hit(["stop"]) and hit(["Ġstop"]) and hit(["s", "to", "pped"])
    assert hit(["Ġst", "op"]) and hit(["las", "tops"]) and hit(["s", "top"]) and hit(["st", "o", "pper"])
    # The string must overlap the newest token, and the tokens before must spell the rest.
    assert not hit(["stop", "at"]) and not hit(["st", "op", "at"]) and not hit(["op", "st"])
    assert not hit(["s", "t", "pped"]) and not hit(["las", "op"])


def test_stop_strings_need_a_tokenizer(smollm2):
    with pytest.raises(ValueError, match="tokenizer"):
        genfn.generate(smollm2, torch.tensor([[504, 2795]]), max_new_tokens=2, stop_strings=["x"])


@pytest.mark.parametrize("stops", [["."], [" Paris", "\n"], ["sea", "is"]])
def test_generate_with_stop_strings_equals_transformers(smollm2, hf_smollm2, stops):
    tok = smollm2.tokenizer
    batch = tok(["Write a haiku about the sea.", "The capital of France is"])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    out = genfn.generate(smollm2, ids, attention_mask=mask, max_new_tokens=12, stop_strings=stops, tokenizer=tok)
    with torch.no_grad():
        ref = hf_smollm2.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, stop_strings=stops,
                                  tokenizer=hf_smollm2_tokenizer(), do_sample=False)
    assert torch.equal(out, ref)
    # A row that stopped ends right after its stop string: the text holds it, and holds it only
    # once the last (non-pad) generated token is included.
    stopped = 0
    for row in out[:, ids.shape[1]:].tolist():
        while row and row[-1] == tok.pad_token_id:
            row.pop()
        text, before = tok.decode(row), tok.decode(row[:-1])
        if any(s in text for s in stops):
            stopped += 1
            assert not any(s in before for s in stops)
    assert stopped, "some row should have stopped on a stop string"


# ---- transformers-shaped criteria -------------------------------------------------------------

import logging  # noqa: E402

from genfn.stopping import (  # noqa: E402
    ConfidenceCriteria,
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StopStringCriteria,
    StoppingCriteriaList,
    call_user_criteria,
    eos_in_new_tokens,
    max_length_reached,
    validate_stopping_criteria,
)


def _random_ids(rows, length, seed=0, vocab=50):
    return torch.randint(vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("length", [3, 7, 8, 12])
def test_max_length_criteria_equals_transformers(length, caplog):
    from transformers.generation import stopping_criteria as hf

    ids = _random_ids(3, length)
    ours, theirs = MaxLengthCriteria(8, max_position_embeddings=10), hf.MaxLengthCriteria(8, max_position_embeddings=10)
    assert torch.equal(ours(ids, None), theirs(ids, None))
    assert ours(ids, None).dtype == torch.bool and ours(ids, None).shape == (3,)


def test_max_length_criteria_reminds_once_past_the_context(caplog):
    ids = _random_ids(2, 12)
    criterion = MaxLengthCriteria(20, max_position_embeddings=11)
    with caplog.at_level(logging.WARNING, logger="genfn"):
        assert not criterion(ids, None).any()
        criterion(_random_ids(2, 13), None)
    reminders = [r for r in caplog.records if "friendly reminder" in r.getMessage()]
    assert len(reminders) == 1 and "maximum length (11)" in reminders[0].getMessage()


def test_max_time_criteria_equals_transformers():
    import time

    from transformers.generation import stopping_criteria as hf

    ids = _random_ids(2, 4)
    for start in (time.time() - 5.0, time.time() + 5.0):
        assert torch.equal(MaxTimeCriteria(1.0, start)(ids, None), hf.MaxTimeCriteria(1.0, start)(ids, None))
    assert not MaxTimeCriteria(60.0)(ids, None).any()
    with pytest.raises(ValueError, match="max_time"):
        MaxTimeCriteria(-1.0)


@pytest.mark.parametrize("eos", [3, [3, 7], torch.tensor([7, 11])])
@pytest.mark.parametrize("new_token_length", [1, 2])
def test_eos_token_criteria_equals_transformers(eos, new_token_length):
    from transformers.generation import stopping_criteria as hf

    ids = _random_ids(64, 5, vocab=12)
    ours = EosTokenCriteria(eos)(ids, None, new_token_length=new_token_length)
    theirs = hf.EosTokenCriteria(eos)(ids, None, new_token_length=new_token_length)
    assert torch.equal(ours, theirs) and ours.any() and not ours.all()


def test_eos_token_criteria_rejects_bad_ids():
    with pytest.raises(TypeError, match="eos_token_id"):
        EosTokenCriteria([2.0])
    with pytest.raises(TypeError, match="eos_token_id"):
        EosTokenCriteria(torch.tensor([1.5]))
    with pytest.raises(ValueError, match="eos_token_id"):
        EosTokenCriteria([-1])


def test_confidence_criteria_per_row_and_like_transformers_for_one_row():
    from transformers.generation import stopping_criteria as hf

    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 10, generator=gen) * 3
    ids = torch.randint(10, (6, 4), generator=gen)
    ours = ConfidenceCriteria(0.1)(ids, (scores,))
    probs = scores.softmax(-1)[torch.arange(6), ids[:, -1]]
    assert torch.equal(ours, probs < 0.1) and ours.any() and not ours.all()
    for row in range(6):
        theirs = hf.ConfidenceCriteria(0.1)(ids[row:row + 1], (scores[row:row + 1],))
        assert bool(ConfidenceCriteria(0.1)(ids[row:row + 1], scores[row:row + 1])[0]) == theirs
    with pytest.raises(ValueError, match="output_scores"):
        ConfidenceCriteria(0.1)(ids, None)
    with pytest.raises(ValueError, match="assistant_confidence_threshold"):
        ConfidenceCriteria(1.5)


def test_stop_string_criteria_equals_transformers(smollm2):
    from transformers.generation import stopping_criteria as hf

    tok = smollm2.tokenizer
    stops = ["stop", " Paris"]
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)[-3:] for text in
                        ("I do not stop", "we go to Paris", "so it stops", "a non-stop!")])
    ours = StopStringCriteria(tok, stops)(ids, None)
    assert torch.equal(ours, hf.StopStringCriteria(hf_smollm2_tokenizer(), stops)(ids, None))
    assert ours.tolist() == [True, True, True, False]  # a stop string inside the newest token counts
    # transformers' tokenizer works too, with the same answers.
    assert torch.equal(StopStringCriteria(hf_smollm2_tokenizer(), stops)(ids, None), ours)


def test_validate_stopping_criteria_like_transformers():
    from transformers.generation import stopping_criteria as hf

    added = validate_stopping_criteria([], 9)
    assert isinstance(added, StoppingCriteriaList) and added.max_length == 9
    assert hf.validate_stopping_criteria(hf.StoppingCriteriaList(), 9).max_length == 9
    original = StoppingCriteriaList([MaxLengthCriteria(5)])
    with pytest.warns(UserWarning, match="different `max_length`"):
        kept = validate_stopping_criteria(original, 9)
    assert kept.max_length == 5 and kept[0] is not original[0]  # a copy, as transformers deep-copies
    assert StoppingCriteriaList([hf.MaxLengthCriteria(4)]).max_length == 4


def test_call_user_criteria_accepts_every_kind_of_criterion():
    from transformers.generation import stopping_criteria as hf

    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def last_is_six(input_ids, scores):
        return input_ids[:, -1] == 6

    assert call_user_criteria(last_is_six, ids, None).tolist() == [False, True]
    assert call_user_criteria([last_is_six, EosTokenCriteria(3)], ids, None).tolist() == [True, True]
    assert call_user_criteria(hf.StoppingCriteriaList([hf.MaxLengthCriteria(3)]), ids, None).tolist() == [True, True]
    assert call_user_criteria(hf.StoppingCriteriaList([hf.MaxLengthCriteria(4)]), ids, None).tolist() == [False, False]
    assert call_user_criteria(StoppingCriteriaList([hf.EosTokenCriteria(3)]), ids, None).tolist() == [True, False]
    assert call_user_criteria([lambda i, s: True], ids, None).tolist() == [True, True]
    assert call_user_criteria([lambda i, s: torch.tensor(False)], ids, None).tolist() == [False, False]
    assert StoppingCriteriaList([last_is_six])(ids, None).tolist() == [False, True]


@pytest.mark.parametrize("answer,detail", [
    (lambda ids: (ids[:, -1] == 6).long(), "torch.int64"),
    (lambda ids: [True, False], "list"),
    (lambda ids: None, "NoneType"),
    (lambda ids: torch.ones(3, dtype=torch.bool), "shape [3]"),
    (lambda ids: torch.ones(2, 1, dtype=torch.bool), "shape [2, 1]"),
])
def test_call_user_criteria_names_a_criterion_that_answers_badly(answer, detail):
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def my_rule(input_ids, scores):
        return answer(input_ids)

    with pytest.raises(TypeError, match="my_rule") as info:
        call_user_criteria([EosTokenCriteria(3), my_rule], ids, None)
    assert detail in str(info.value) and "[2]" in str(info.value)
    with pytest.raises(TypeError, match="stopping_criteria"):
        call_user_criteria([3], ids, None)


def test_generate_takes_transformers_criteria_and_names_a_bad_one():
    import transformers

    from conftest import tiny_pair

    _, gm = tiny_pair()
    criteria = transformers.StoppingCriteriaList([transformers.MaxLengthCriteria(6)])
    out = genfn.generate(gm, torch.tensor([[7, 8, 9]]), max_new_tokens=10, eos_token_id=None,
                         stopping_criteria=criteria)
    assert out.shape == (1, 6)

    def floats_rule(input_ids, scores):
        return torch.zeros(input_ids.shape[0])

    with pytest.raises(TypeError, match="floats_rule"):
        genfn.generate(gm, torch.tensor([[7, 8, 9]]), max_new_tokens=4, stopping_criteria=[floats_rule])


def test_pure_checks_take_per_row_lengths():
    cur_len = torch.tensor([3, 5, 8])
    assert max_length_reached(cur_len, torch.tensor([3, 6, 8])).tolist() == [True, False, True]
    assert max_length_reached(cur_len, torch.tensor(5)).tolist() == [False, True, True]
    assert max_length_reached(torch.tensor(4), torch.tensor(4), 2).tolist() == [True, True]
    tokens = torch.tensor([[1, 2, 9, 0, 9, 9, 9, 9],
                           [1, 9, 2, 2, 2, 9, 9, 9],
                           [1, 2, 2, 2, 2, 2, 9, 2]])
    # Row 0 appended columns 2..2 (an eos), row 1 appended 3..4 (no eos), row 2 appended 6..7.
    old_len = torch.tensor([2, 3, 6])
    assert eos_in_new_tokens(tokens, old_len, cur_len, (9,)).tolist() == [True, False, True]
    # A finished row appends nothing: nothing new can be an eos.
    assert eos_in_new_tokens(tokens, cur_len, cur_len, (9,)).tolist() == [False, False, False]
    assert eos_in_new_tokens(tokens, old_len, cur_len, ()).tolist() == [False, False, False]


class _PlainVocab:
    """A vocabulary whose tokens spell themselves (no tokenizers backend)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def get_vocab(self):
        return {t: i for i, t in enumerate(self.tokens)}


def test_stop_checks_compile_with_per_row_lengths():
    vocab = ["a", "b", "st", "op", "stop", "x", "s", "top"]
    matcher = StopStringMatcher.from_tokenizer(_PlainVocab(vocab), ["stop", "ab"])

    def check(tokens, old_len, cur_len, max_length):
        return matcher(tokens, cur_len) | max_length_reached(cur_len, max_length) | eos_in_new_tokens(
            tokens, old_len, cur_len, (5,))

    compiled = torch.compile(check, fullgraph=True, dynamic=False)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(len(vocab), (64, 10), generator=gen)
    for _ in range(3):
        cur_len = torch.randint(1, 11, (64,), generator=gen)
        old_len = (cur_len - torch.randint(0, 2, (64,), generator=gen)).clamp(min=0)
        expected = check(tokens, old_len, cur_len, torch.tensor(10))
        assert torch.equal(compiled(tokens, old_len, cur_len, torch.tensor(10)), expected)
        assert expected.any() and not expected.all()


def test_stop_string_in_any_of_several_new_tokens():
    from genfn.stopping import stop_string_in_new_tokens

    vocab = ["a", "b", "st", "op", "stop", "x", "s", "top"]
    matcher = StopStringMatcher.from_tokenizer(_PlainVocab(vocab), ["stop"])
    t = {tok: i for i, tok in enumerate(vocab)}
    tokens = torch.tensor([[t["a"], t["st"], t["op"], t["x"], t["x"], 0],   # "stop" ends at column 2
                           [t["a"], t["st"], t["op"], t["x"], t["x"], 0],
                           [t["x"], t["s"], t["top"], t["x"], 0, 0]])
    cur_len = torch.tensor([5, 5, 4])
    # Row 0 appended columns 2..4 (the string ends inside them); row 1 appended only 3..4 (it ended
    # before); row 2 appended 2..3 ("s" + "top" ends at column 2).
    old_len = torch.tensor([2, 3, 2])
    assert stop_string_in_new_tokens(matcher, tokens, old_len, cur_len, 3).tolist() == [True, False, True]
    assert matcher(tokens, cur_len).tolist() == [False, False, False]  # the newest token alone misses them
    assert stop_string_in_new_tokens(matcher, tokens, cur_len, cur_len, 3).tolist() == [False, False, False]
