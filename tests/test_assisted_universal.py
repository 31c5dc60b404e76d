"""Universal assisted generation: an assistant with another tokenizer drafts through text, the target
verifies, and the tokens are plain greedy's (batch 1 and batch 4 with rows of different lengths),
including when every draft is kept and when every draft is rejected.

The tokenizers are built here with ``tokenizers``: the target reads words (a WordLevel vocabulary of
95 made-up words), one assistant a byte-level BPE trained on sentences of those words, another the
same words under permuted ids (with the target's weights permuted to match: it drafts exactly the
target's tokens), another words the target does not know.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import genfn
from genfn.models.model import from_hf_state_dict
from genfn.strategies.assisted.universal import align_new_tokens, continuation, longest_common_run
from tests.conftest import tiny_hf_model

NEW = 20
UNK = 1
GREEDY = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=2, num_assistant_tokens=4)


def _made_up_words(consonants: str, count: int) -> list[str]:
    syllables = [c + v for c in consonants for v in "aeiou"]
    return [a + b for a, b in itertools.islice(itertools.product(syllables, syllables), 0, count * 7, 7)]


WORDS = _made_up_words("bdfgklmnprst", 95)


def _word_tokenizer(words: list[str]) -> Tokenizer:
    """ids 0 [PAD] (special: skipped when decoding), 1 [UNK], then ``words``; words join with spaces."""
    vocab = {"[PAD]": 0, "[UNK]": UNK, **{word: i + 2 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["[PAD]"])
    return tokenizer


def _bpe_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on sentences of the target's words: it splits them differently."""
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(200)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(sentences, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>"],
                                                                 show_progress=False))
    return tokenizer


@pytest.fixture(scope="module")
def setup():
    hf, config = tiny_hf_model("LlamaForCausalLM", seed=0)
    target = from_hf_state_dict(config, hf.state_dict())
    target_tokenizer = _word_tokenizer(WORDS)

    # The same model under permuted ids, read by a tokenizer with the same words permuted to match.
    order = torch.randperm(97, generator=torch.Generator().manual_seed(1))  # assistant id a is target id order[a]
    state = dict(hf.state_dict())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][order].clone()
    permuted = from_hf_state_dict(config, state)
    names = {i: word for word, i in target_tokenizer.get_vocab().items()}
    permuted_tokenizer = Tokenizer(models.WordLevel({names[int(order[a])]: a for a in range(97)},
                                                    unk_token="[UNK]"))
    permuted_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    permuted_tokenizer.add_special_tokens(["[PAD]"])
    permuted.generation_config.eos_token_id = int((order == 2).nonzero())

    bpe_tokenizer = _bpe_tokenizer(150)
    bpe_hf, bpe_config = tiny_hf_model("LlamaForCausalLM", seed=3, vocab_size=bpe_tokenizer.get_vocab_size())
    bpe_assistant = from_hf_state_dict(bpe_config, bpe_hf.state_dict())

    stranger_tokenizer = _word_tokenizer(_made_up_words("BDFGKLMNPRST", 95))
    stranger_hf, stranger_config = tiny_hf_model("LlamaForCausalLM", seed=4)
    stranger = from_hf_state_dict(stranger_config, stranger_hf.state_dict())
    return dict(hf=hf, target=target, tokenizer=target_tokenizer, permuted=(permuted, permuted_tokenizer),
                bpe=(bpe_assistant, bpe_tokenizer), stranger=(stranger, stranger_tokenizer))


def _rows(lengths, seed=0):
    """Left-padded prompts of word ids (2..96) with a mask."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 97, (length,), generator=g) for length in lengths]
    width = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.int64), r]) for r in rows])
    mask = (torch.arange(width).unsqueeze(0) >= (width - torch.tensor(lengths)).unsqueeze(1)).long()
    return ids, mask


BATCHES = {"batch1": _rows([9]), "batch4": _rows([4, 7, 12, 16])}


def _universal(setup, name, ids, mask, **settings):
    assistant, assistant_tokenizer = setup[name]
    return genfn.generate(setup["target"], ids, attention_mask=mask, assistant_model=assistant,
                          tokenizer=setup["tokenizer"], assistant_tokenizer=assistant_tokenizer,
                          return_dict_in_generate=True, **{**GREEDY, **settings})


def _plain(setup, ids, mask, **settings):
    settings = {**GREEDY, **settings}
    settings.pop("num_assistant_tokens")
    return genfn.generate(setup["target"], ids, attention_mask=mask, **settings)


@pytest.mark.parametrize("batch", list(BATCHES))
def test_bpe_assistant_gives_plain_greedy(setup, batch):
    ids, mask = BATCHES[batch]
    out = _universal(setup, "bpe", ids, mask)
    assert torch.equal(out.sequences, _plain(setup, ids, mask))
    assert int(out.acceptance["total_proposed"]) > 0  # drafts reached the target


@pytest.mark.parametrize("batch", list(BATCHES))
def test_same_model_other_tokenizer_every_draft_kept(setup, batch):
    ids, mask = BATCHES[batch]
    out = _universal(setup, "permuted", ids, mask)
    assert torch.equal(out.sequences, _plain(setup, ids, mask))
    acceptance = out.acceptance
    assert int(acceptance["total_proposed"]) > 0
    assert torch.equal(acceptance["accepted"], acceptance["proposed"])
    # Every round kept its block: far fewer target forwards than tokens.
    assert int(acceptance["total_rounds"]) < ids.shape[0] * (NEW - 1) / 2


@pytest.mark.parametrize("batch", list(BATCHES))
def test_assistant_of_unknown_words_every_draft_rejected(setup, batch):
    """The stranger's words are all [UNK] to the target, which never picks [UNK] (suppressed)."""
    ids, mask = BATCHES[batch]
    out = _universal(setup, "stranger", ids, mask, suppress_tokens=[UNK])
    assert torch.equal(out.sequences, _plain(setup, ids, mask, suppress_tokens=[UNK]))
    assert int(out.acceptance["total_proposed"]) > 0
    assert int(out.acceptance["total_accepted"]) == 0


def test_sampling_with_universal_assistant_keeps_plain_sampling(setup):
    """Drafts without a distribution are kept only where they equal the target's own keyed sample."""
    ids, mask = BATCHES["batch4"]
    sampled = dict(do_sample=True, top_k=0, temperature=0.8, key=genfn.random.key(11))
    out = _universal(setup, "permuted", ids, mask, **sampled)
    assert torch.equal(out.sequences, _plain(setup, ids, mask, **sampled))


def test_lookbehind_windows_change_nothing_but_the_drafts(setup):
    ids, mask = BATCHES["batch4"]
    narrow = _universal(setup, "bpe", ids, mask, assistant_lookbehind=2, target_lookbehind=3)
    assert torch.equal(narrow.sequences, _plain(setup, ids, mask))


def test_strategy_runs_eagerly(setup):
    ids, mask = BATCHES["batch1"]
    _universal(setup, "permuted", ids, mask, cache_implementation="static")
    assert not any("universal" in str(key) for key in setup["target"].compiled_steps)


def test_equals_transformers_universal_assisted_generate(setup):
    """transformers' own universal assisted generation (its tokenizer classes, its models) gives the same tokens."""
    import transformers

    target_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=setup["tokenizer"], pad_token="[PAD]",
                                                            unk_token="[UNK]")
    assistant, bpe = setup["bpe"]
    assistant_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>")
    hf_assistant, _ = tiny_hf_model("LlamaForCausalLM", seed=3, vocab_size=bpe.get_vocab_size())
    ids, mask = BATCHES["batch1"]
    settings = dict(GREEDY, tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer)
    ours = genfn.generate(setup["target"], ids, attention_mask=mask, assistant_model=assistant, **settings)
    with torch.no_grad():
        theirs = setup["hf"].generate(ids, attention_mask=mask, assistant_model=hf_assistant, **settings)
    assert torch.equal(ours, theirs)


def test_wrapped_module_target_gives_its_own_greedy(setup):
    """The target may be a transformers module wrapped with genfn.from_module (rows at their own slots)."""
    ids, mask = BATCHES["batch4"]
    assistant, assistant_tokenizer = setup["bpe"]
    wrapped = genfn.from_module(setup["hf"])
    out = genfn.generate(wrapped, ids, attention_mask=mask, assistant_model=assistant, tokenizer=setup["tokenizer"],
                         assistant_tokenizer=assistant_tokenizer, **GREEDY)
    settings = {**GREEDY}
    settings.pop("num_assistant_tokens")
    with torch.no_grad():
        assert torch.equal(out, setup["hf"].generate(ids, attention_mask=mask, **settings))


def test_smollm2_with_a_tiny_assistant_of_its_own_tokenizer(smollm2):
    """SmolLM2 (its GGUF tokenizer) verifies drafts of a tiny random model reading a byte-level BPE."""
    english = ["The committee met on Tuesday and agreed that the new library will open in the spring.",
               "After the roof repairs are finished, the reading rooms and the garden will reopen.",
               "Rewrite the passage in plain words for a young reader."] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(english, trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf, config = tiny_hf_model("LlamaForCausalLM", seed=5, vocab_size=bpe.get_vocab_size())
    assistant = from_hf_state_dict(config, hf.state_dict())
    ids = torch.tensor([smollm2.tokenizer.encode("Rewrite in plain words: the committee met on Tuesday and")])
    plain = genfn.generate(smollm2, ids, max_new_tokens=10)
    out = genfn.generate(smollm2, ids, max_new_tokens=10, assistant_model=assistant, tokenizer=smollm2.tokenizer,
                         assistant_tokenizer=bpe, num_assistant_tokens=3, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert int(out.acceptance["total_proposed"]) > 0


def test_different_vocabulary_without_tokenizers_is_refused(setup):
    ids, mask = BATCHES["batch1"]
    assistant, assistant_tokenizer = setup["bpe"]
    with pytest.raises(ValueError, match="tokenizer=.*assistant_tokenizer="):
        genfn.generate(setup["target"], ids, attention_mask=mask, assistant_model=assistant, **GREEDY)
    with pytest.raises(ValueError, match="assistant_tokenizer= is given without tokenizer="):
        genfn.generate(setup["target"], ids, attention_mask=mask, assistant_model=assistant,
                       assistant_tokenizer=assistant_tokenizer, **GREEDY)
    with pytest.raises(ValueError, match="assistant_tokenizer= is only used"):
        genfn.generate(setup["target"], ids, attention_mask=mask, tokenizer=setup["tokenizer"],
                       assistant_tokenizer=assistant_tokenizer, max_new_tokens=3)


def test_ensemble_weight_is_refused(setup):
    ids, mask = BATCHES["batch1"]
    with pytest.raises(ValueError, match="assistant_ensemble_weight"):
        _universal(setup, "bpe", ids, mask, assistant_ensemble_weight=0.5)


def test_tokenizer_without_encode_is_refused(setup):
    ids, mask = BATCHES["batch1"]
    assistant, _ = setup["bpe"]
    with pytest.raises(TypeError, match="assistant_tokenizer must be a tokenizer"):
        genfn.generate(setup["target"], ids, attention_mask=mask, assistant_model=assistant,
                       tokenizer=setup["tokenizer"], assistant_tokenizer=object(), **GREEDY)


def _transformers_alignment(old, new):
    """transformers' own diagonal search (the oracle) as ``(replace, fix, extra)``."""
    from transformers.generation.candidate_generator import AssistedCandidateGeneratorDifferentTokenizers

    replace, extra, fix = AssistedCandidateGeneratorDifferentTokenizers._get_tokens_diag(
        np.array([old]), np.array([new]))
    if replace is None:
        return None
    return int(replace), [int(t) for t in fix[0]], [int(t) for t in extra[0]]


def test_alignment_matches_transformers_diagonal_search():
    rng = random.Random(5)
    checked = 0
    for _ in range(300):
        old = [rng.randrange(6) for _ in range(rng.randrange(1, 9))]
        keep = rng.randrange(len(old) + 1)
        new = old[keep:][: rng.randrange(len(old) - keep + 1)] + [rng.randrange(6) for _ in range(rng.randrange(4))]
        if not new:
            continue
        assert align_new_tokens(old, new) == _transformers_alignment(old, new), (old, new)
        checked += 1
    assert checked > 200


def test_longest_common_run_prefers_the_longest_then_the_first():
    assert longest_common_run([1, 2, 3, 4, 9, 1], [9, 1, 2, 3, 4, 5]) == (1, 0, 4)
    assert longest_common_run([1, 2, 3, 9, 1, 2], [9, 1, 2, 3, 4]) == (0, 3, 3)  # a tie: the first in new
    assert longest_common_run([1, 2], [3, 4]) is None


def test_continuation_places_the_boundary_in_repetitive_text():
    """A run of one token matches at every offset; the known re-encoding of the old tail does not."""
    old = [5, 7, 7, 7, 7]
    known = [7, 7, 7]  # the re-encoded window of old's tail (its first token may differ at a word boundary)
    new = [7, 7, 7, 7, 7, 8]  # that window plus the drafts 7, 7, 8
    assert continuation(old, known, new) == [7, 7, 8]
    assert align_new_tokens(old, new)[2] != [7, 7, 8]  # the longest-run search alone loses drafts here
    assert continuation(old, [7, 9], new) is None  # re-encodings disagree: the caller falls back
