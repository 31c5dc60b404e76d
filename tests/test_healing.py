"""Token healing: the prompt tail is regenerated among its vocabulary extensions, as transformers'
heal_tokens does."""

import pytest
import torch

import genfn
from genfn.healing import heal_tokens, token_extensions
from hf_tokenizer import hf_smollm2_tokenizer

PROMPTS = ['The link is <a href="http:', 'The link is <a href="http', "I read the book. It was fantas", "x = [1, 2,"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_healed_generation_equals_transformers(smollm2, hf_smollm2, prompt):
    hf_tok = hf_smollm2_tokenizer()
    ids = torch.tensor([hf_tok(prompt)["input_ids"]])
    assert ids.tolist() == [smollm2.tokenizer.encode(prompt)]
    out = genfn.generate(smollm2, ids, max_new_tokens=4, token_healing=True, tokenizer=smollm2.tokenizer)
    with torch.no_grad():
        ref = hf_smollm2.generate(input_ids=ids, max_new_tokens=4, token_healing=True, tokenizer=hf_tok,
                                  do_sample=False)
    assert torch.equal(out, ref)


def test_heal_tokens_rewrites_the_tail(smollm2):
    tok = smollm2.tokenizer
    ids = torch.tensor([tok.encode('The link is <a href="http:')])
    healed, mask = heal_tokens(smollm2, ids, tok, generate=genfn.generate)
    assert healed.shape == ids.shape and bool(mask.all())
    assert torch.equal(healed[0, :-1], ids[0, :-1])
    assert tok.decode(healed[0]).startswith('The link is <a href="http:') and healed[0, -1] != ids[0, -1]
    # Every candidate starts with the tail's spelling.
    tail = tok.convert_ids_to_tokens(int(ids[0, -1]))
    candidates = token_extensions(tok, int(ids[0, -1]))
    assert int(ids[0, -1]) in candidates and int(healed[0, -1]) in candidates
    assert all(tok.convert_ids_to_tokens(c).startswith(tail) for c in candidates)


def test_batched_healing_equals_healing_each_prompt(smollm2):
    tok = smollm2.tokenizer
    prompts = [PROMPTS[0], PROMPTS[3]]
    batch = tok(prompts)
    healed, mask = heal_tokens(smollm2, batch["input_ids"], tok, batch["attention_mask"], generate=genfn.generate)
    for i, prompt in enumerate(prompts):
        alone, _ = heal_tokens(smollm2, torch.tensor([tok.encode(prompt)]), tok, generate=genfn.generate)
        assert healed[i][mask[i].bool()].tolist() == alone[0].tolist()


def test_token_healing_needs_a_tokenizer(smollm2):
    with pytest.raises(ValueError, match="tokenizer"):
        genfn.generate(smollm2, torch.tensor([[504, 2795]]), max_new_tokens=2, token_healing=True)
