"""Every genfn strategy on a module wrapped with ``genfn.from_module``: it runs (and equals the module's own
``generate`` where that is deterministic) or refuses clearly.

Speculative decoding keeps a different number of drafts per row and rewinds each row's cache pointer, so
the rows of one forward sit at different slots: the cache bridge hands the module a per-row mask. The
tests use prompts that repeat themselves, so prompt lookup's acceptance differs between rows, and check
that it does (otherwise the rows would never part and the test would prove nothing).
"""

from __future__ import annotations

import weakref

import pytest
import torch

import genfn
from genfn.generation import STRATEGIES
from genfn.strategies.assisted.block import BlockDrafter
from tests.conftest import tiny_hf_model

ARCHS = ["LlamaForCausalLM", "GPT2LMHeadModel", "Qwen2ForCausalLM"]
NEW = 12
GREEDY = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=2)


def _tiny(arch: str, seed: int):
    import transformers

    if arch == "GPT2LMHeadModel":
        torch.manual_seed(seed)
        # A wider initialization than GPT-2's 0.02, whose tiny random model only repeats its last token.
        config = transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                         initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        return transformers.GPT2LMHeadModel(config).eval()
    return tiny_hf_model(arch, seed)[0]


@pytest.fixture(scope="module", params=ARCHS)
def wrapped(request):
    """(the transformers module, it wrapped, a differently seeded wrapped assistant, a second wrap of the module)."""
    hf = _tiny(request.param, seed=0)
    return hf, genfn.from_module(hf), genfn.from_module(_tiny(request.param, seed=1)), genfn.from_module(hf)


def _repetitive_rows(lengths, seed=0):
    """Left-padded rows that repeat their first half (prompt lookup finds matches in them)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        head = torch.randint(3, 97, (length,), generator=g)
        rows.append(torch.cat([head, head[: length // 2], head]))
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.int64), r]) for r in rows])
    real = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(width).unsqueeze(0) >= (width - real).unsqueeze(1)).long()
    return ids, mask


BATCHES = {"batch1": _repetitive_rows([7]), "batch4": _repetitive_rows([3, 5, 7, 9])}


# Held per module object (an id() could be reused by a later module once this one is freed).
_OWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _own_generate(hf, ids, mask, **settings):
    """The module's own generate (greedy unless ``settings`` say otherwise), computed once per input."""
    key = (ids.shape, tuple(ids.reshape(-1).tolist()), tuple(sorted(settings.items())))
    results = _OWN.setdefault(hf, {})
    if key not in results:
        with torch.no_grad():
            results[key] = hf.generate(ids, attention_mask=mask, **{**GREEDY, **settings})
    return results[key]


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_at_different_slots_equal_each_row_alone(arch):
    """The cache bridge's per-row mask: a forward whose rows were rewound to different lengths gives each
    row the logits it gets alone (one shared query offset would shift every row but the first)."""
    model = genfn.from_module(_tiny(arch, seed=2))
    step = model.functional()
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(3))
    block = torch.randint(3, 97, (1, 3), generator=torch.Generator().manual_seed(4))

    def forward(rows, lengths):
        cache = model.init_cache(rows.shape[0], 32, "static")
        _, cache = step.apply(rows, torch.arange(8).expand(rows.shape[0], 8), cache)
        lengths = torch.tensor(lengths)
        cache = cache.rewind(lengths)
        logits, _ = step.apply(block.expand(rows.shape[0], 3), lengths.unsqueeze(1) + torch.arange(3), cache)
        return logits

    together = forward(ids, [8, 5])
    torch.testing.assert_close(together[0], forward(ids[:1], [8])[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together[1], forward(ids[1:], [5])[0], rtol=1e-5, atol=1e-5)


PROPOSERS = {
    "prompt_lookup": lambda assistant, same: dict(prompt_lookup_num_tokens=3),
    "draft_model_random": lambda assistant, same: dict(assistant_model=assistant, num_assistant_tokens=3),
    "draft_model_same_weights": lambda assistant, same: dict(assistant_model=same, num_assistant_tokens=3),
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_assisted_greedy_equals_module_generate(wrapped, proposer, batch):
    hf, model, assistant, same = wrapped
    ids, mask = BATCHES[batch]
    theirs = _own_generate(hf, ids, mask)
    out = genfn.generate(model, ids, attention_mask=mask, return_dict_in_generate=True, **GREEDY,
                         **PROPOSERS[proposer](assistant, same))
    if proposer == "prompt_lookup":
        assert torch.equal(genfn.generate(model, ids, attention_mask=mask, **GREEDY), theirs)  # plain greedy too
    assert torch.equal(out.sequences, theirs)
    acceptance = out.acceptance
    if proposer == "draft_model_same_weights":
        # The assistant is the target: every offered draft is the target's own greedy token.
        assert torch.equal(acceptance["accepted"], acceptance["proposed"])
        assert int(acceptance["total_accepted"]) > 0
    if proposer == "prompt_lookup" and batch == "batch4":
        # The rows parted: they kept different numbers of drafts, so they wrote at different slots.
        assert len(set(acceptance["accepted"].tolist())) > 1, acceptance


def test_assisted_static_cache_on_wrapped_module(wrapped):
    hf, model, assistant, _ = wrapped
    ids, mask = BATCHES["batch4"]
    out = genfn.generate(model, ids, attention_mask=mask, cache_implementation="static", disable_compile=True,
                         prompt_lookup_num_tokens=3, **GREEDY)
    assert torch.equal(out, _own_generate(hf, ids, mask))


def test_prompt_lookup_sampling_equals_plain_sampling(wrapped):
    """Prompt lookup has no distribution: drafts are kept when they equal the target's own sample, so the
    same key gives plain sampling's tokens."""
    _, model, _, _ = wrapped
    ids, mask = BATCHES["batch4"]
    sampled = dict(GREEDY, do_sample=True, top_k=0, temperature=0.7)
    plain = genfn.generate(model, ids, attention_mask=mask, key=genfn.random.key(5), **sampled)
    assisted = genfn.generate(model, ids, attention_mask=mask, key=genfn.random.key(5), prompt_lookup_num_tokens=3,
                              **sampled)
    assert torch.equal(assisted, plain)


def test_early_exit_refuses_a_wrapped_module(wrapped):
    _, model, _, _ = wrapped
    ids, mask = BATCHES["batch1"]
    with pytest.raises(ValueError, match="assistant_early_exit.*genfn.from_module"):
        genfn.generate(model, ids, attention_mask=mask, assistant_early_exit=1, **GREEDY)


def test_mtp_refuses_a_wrapped_module(wrapped):
    _, model, _, _ = wrapped
    ids, mask = BATCHES["batch1"]
    with pytest.raises(ValueError, match="use_mtp=True needs a model with multi-token-prediction heads"):
        genfn.generate(model, ids, attention_mask=mask, use_mtp=True, **GREEDY)


def _block_head(params, hidden, newest):
    return (hidden[:, -1] @ params).reshape(hidden.shape[0], 3, -1)


def test_block_drafter_on_wrapped_module(wrapped):
    """speculation_type="dflash" reads the module's final hidden states (output_hidden_states through the
    bridge); a random block head drafts, verification keeps the module's greedy tokens."""
    hf, model, _, _ = wrapped
    ids, mask = BATCHES["batch4"]
    hidden = hf.config.get_text_config().hidden_size if hasattr(hf.config, "get_text_config") else 64
    params = torch.randn(hidden, 3 * model.vocab_size, generator=torch.Generator().manual_seed(6))
    drafter = BlockDrafter(head=_block_head, params=params, num_tokens=3)
    out = genfn.generate(model, ids, attention_mask=mask, assistant_model=drafter, speculation_type="dflash",
                         **GREEDY)
    assert torch.equal(out, _own_generate(hf, ids, mask))


# Every mode generate routes to a built-in strategy (generation.STRATEGIES), plus the strategies chosen by
# other settings (guidance, the assisted proposers above), on the wrapped module.
MODES = {
    "greedy_search": dict(),
    "sample": dict(do_sample=True, top_k=10),
    "beam_search": dict(num_beams=3),
    "beam_sample": dict(num_beams=2, do_sample=True, top_k=10),
    "guidance": dict(guidance_scale=1.5),
}


def test_every_mode_is_covered():
    assert {mode.value for mode in STRATEGIES} <= set(MODES)


@pytest.mark.parametrize("mode", list(MODES))
def test_every_strategy_runs_on_wrapped_module(wrapped, mode):
    hf, model, _, _ = wrapped
    ids, mask = BATCHES["batch4"]
    settings = dict(GREEDY, **MODES[mode])
    first = genfn.generate(model, ids, attention_mask=mask, key=genfn.random.key(3), **settings)
    assert first.shape[0] == ids.shape[0] and first.shape[1] > ids.shape[1]
    if settings.get("do_sample"):
        again = genfn.generate(model, ids, attention_mask=mask, key=genfn.random.key(3), **settings)
        assert torch.equal(first, again)
    else:
        assert torch.equal(first, _own_generate(hf, ids, mask, **MODES[mode]))


@pytest.mark.parametrize("arch, settings", [
    ("MistralForCausalLM", dict(sliding_window=4)),
    ("Qwen2ForCausalLM", dict(sliding_window=4, use_sliding_window=True, max_window_layers=1)),  # one mask per layer type
    ("LlamaForCausalLM", dict(attn_implementation="eager")),  # an additive mask
], ids=["mistral_window", "qwen2_mixed_layers", "llama_eager"])
def test_per_row_masks_of_windows_and_eager_attention(arch, settings):
    """Sliding windows count each row's real tokens (the growing default cache leaves holes where rows were
    rewound); eager attention takes the mask additively."""
    hf = tiny_hf_model(arch, 0, **settings)[0]
    model = genfn.from_module(hf)
    ids, mask = BATCHES["batch4"]
    out = genfn.generate(model, ids, attention_mask=mask, return_dict_in_generate=True, prompt_lookup_num_tokens=3,
                         **GREEDY)
    assert torch.equal(out.sequences, _own_generate(hf, ids, mask))
    assert len(set(out.acceptance["accepted"].tolist())) > 1  # the rows parted


class _PlainMaskModule(torch.nn.Module):
    """A module that is not a transformers model (no config): genfn knows only that it takes a 2-D mask."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                          use_cache=use_cache)


def test_module_with_only_a_2d_mask_runs_assisted_at_batch_1_and_refuses_batch_4():
    hf = _tiny("LlamaForCausalLM", seed=0)
    model = genfn.from_module(_PlainMaskModule(hf))
    assert not model.spec.rows_independent
    ids, mask = BATCHES["batch1"]
    out = genfn.generate(model, ids, attention_mask=mask, prompt_lookup_num_tokens=3, **GREEDY)
    assert torch.equal(out, _own_generate(hf, ids, mask))
    ids, mask = BATCHES["batch4"]
    with pytest.raises(ValueError, match="batch size 4 needs the model to take each row at its own cache slot"):
        genfn.generate(model, ids, attention_mask=mask, prompt_lookup_num_tokens=3, **GREEDY)


def test_compiled_speculative_step_on_wrapped_module():
    """The per-row mask traces: prompt lookup on a wrapped GPT-2 through the compiled driver (fullgraph; the
    eager backend keeps the compile cheap) equals the module's own generate at batch 4."""
    hf = _tiny("GPT2LMHeadModel", seed=0)
    model = genfn.from_module(hf)
    ids, mask = BATCHES["batch4"]
    compiled = genfn.generate(model, ids, attention_mask=mask, prompt_lookup_num_tokens=3,
                              cache_implementation="static",
                              compile_config=genfn.CompileConfig(fullgraph=True, backend="eager", mode=None), **GREEDY)
    assert model.compiled_steps, "the speculative step did not go through the compiled path"
    assert torch.equal(compiled, _own_generate(hf, ids, mask))
