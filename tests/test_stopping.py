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
