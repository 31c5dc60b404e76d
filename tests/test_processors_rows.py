"""Per-row processors: rows at their own lengths, numbers as ``[B]`` leaves, batches of mixed
requests, one compiled step for every value, and transformers-style callables.

The oracle is transformers, one request at a time: row ``b`` of a batch must equal the
transformers processor built with row ``b``'s value, applied to row ``b``'s ``input_ids``
(``tokens[b, :cur_len[b]]``); a row whose value is "off" (the kind is absent) must come out
untouched.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.utils._pytree as torch_pytree

import transformers.generation.logits_process as hf
from genfn.processors import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ExternalLogitsProcessor,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsContext,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    ProcessorChain,
    RepetitionPenaltyLogitsProcessor,
    RowSelect,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    WatermarkLogitsProcessor,
    build_logits_processors,
    build_logits_processors_for_rows,
)

V = 50
EOS = [3, 7]
# Four rows at their own positions: mid-generation, the first decode step, a decoder start of one
# token (forced BOS applies), and a long row with many repeats.
CUR_LENS = [14, 8, 1, 20]
PROMPT_LENS = [8, 8, 1, 6]


def rows_batch(seed: int, token_range: int = 8):
    """Rows starting at column 0 with their own lengths and garbage past them; random logits."""
    g = torch.Generator().manual_seed(seed)
    width = 24
    tokens = torch.randint(0, token_range, (len(CUR_LENS), width), generator=g)
    for row, n in enumerate(CUR_LENS):
        tokens[row, n:] = torch.randint(-(10**6), 10**6, (width - n,), generator=g)
    logits = torch.randn((len(CUR_LENS), V), generator=g) * 3
    logits[0, :4] = -math.inf  # as after an earlier truncation
    ctx = LogitsContext(tokens=tokens, cur_len=torch.tensor(CUR_LENS), prompt_len=torch.tensor(PROMPT_LENS))
    return ctx, logits


def row_ids(ctx: LogitsContext, row: int) -> torch.Tensor:
    return ctx.tokens[row : row + 1, : CUR_LENS[row]].clone()


def prompt_ids(ctx: LogitsContext, row: int) -> torch.Tensor:
    return ctx.tokens[row : row + 1, : PROMPT_LENS[row]].clone()


# (name, values per row (None: the kind is absent), genfn factory(value), transformers factory(value, ctx, row))
KINDS = [
    ("temperature", [0.5, None, 1.7, 0.9], TemperatureLogitsWarper, lambda v, c, r: hf.TemperatureLogitsWarper(v)),
    ("top_k", [3, None, 500, 1], TopKLogitsWarper, lambda v, c, r: hf.TopKLogitsWarper(v)),
    ("top_k_keep", [2, 9, None, 1], lambda v: TopKLogitsWarper(v, min_tokens_to_keep=3),
     lambda v, c, r: hf.TopKLogitsWarper(v, min_tokens_to_keep=3)),
    ("top_p", [0.5, None, 0.95, 0.2], TopPLogitsWarper, lambda v, c, r: hf.TopPLogitsWarper(v)),
    ("top_p_keep", [0.1, 0.6, None, 0.9], lambda v: TopPLogitsWarper(v, min_tokens_to_keep=3),
     lambda v, c, r: hf.TopPLogitsWarper(v, min_tokens_to_keep=3)),
    ("min_p", [0.1, None, 0.9, 0.05], MinPLogitsWarper, lambda v, c, r: hf.MinPLogitsWarper(v)),
    ("top_h", [0.4, None, 0.9, 0.2], TopHLogitsWarper, lambda v, c, r: hf.TopHLogitsWarper(v)),
    ("typical", [0.7, None, 0.2, 0.95], TypicalLogitsWarper, lambda v, c, r: hf.TypicalLogitsWarper(v)),
    ("epsilon", [0.02, None, 0.5, 0.1], EpsilonLogitsWarper, lambda v, c, r: hf.EpsilonLogitsWarper(v)),
    ("eta", [0.05, None, 0.5, 0.2], EtaLogitsWarper, lambda v, c, r: hf.EtaLogitsWarper(v)),
    ("repetition", [1.5, None, 0.6, 2.0], RepetitionPenaltyLogitsProcessor,
     lambda v, c, r: hf.RepetitionPenaltyLogitsProcessor(v)),
    ("repetition_ignore", [(1.5, 3), None, (0.6, 0), (2.0, 5)],
     lambda v: RepetitionPenaltyLogitsProcessor(v[0], prompt_ignore_length=v[1]),
     lambda v, c, r: hf.RepetitionPenaltyLogitsProcessor(v[0], prompt_ignore_length=v[1])),
    ("encoder_repetition", [1.7, None, 0.8, 1.2], EncoderRepetitionPenaltyLogitsProcessor,
     lambda v, c, r: hf.EncoderRepetitionPenaltyLogitsProcessor(v, prompt_ids(c, r))),
    ("no_repeat", [1, None, 2, 3], NoRepeatNGramLogitsProcessor, lambda v, c, r: hf.NoRepeatNGramLogitsProcessor(v)),
    ("no_repeat_mixed", [2, 4, 1, 3], NoRepeatNGramLogitsProcessor,
     lambda v, c, r: hf.NoRepeatNGramLogitsProcessor(v)),
    ("encoder_no_repeat", [2, None, 1, 3], EncoderNoRepeatNGramLogitsProcessor,
     lambda v, c, r: hf.EncoderNoRepeatNGramLogitsProcessor(v, prompt_ids(c, r))),
    ("sequence_bias", [{(4,): 2.5, (1, 2): -1.5}, None, {(4,): -1.0, (2, 3): 3.0}, {(1, 2, 2): 1.25, (3,): 0.5}],
     SequenceBiasLogitsProcessor.create, lambda v, c, r: hf.SequenceBiasLogitsProcessor(v)),
    ("bad_words", [[[5], [1, 2]], None, [[6]], [[2, 1, 3], [4, 4], [3]]],
     lambda v: NoBadWordsLogitsProcessor.create(v, eos_token_id=EOS),
     lambda v, c, r: hf.NoBadWordsLogitsProcessor(v, eos_token_id=EOS)),
    ("min_length", [12, None, 5, 22], lambda v: MinLengthLogitsProcessor(v, EOS),
     lambda v, c, r: hf.MinLengthLogitsProcessor(v, EOS)),
    ("min_new_tokens", [7, None, 1, 10], lambda v: MinNewTokensLengthLogitsProcessor(None, v, EOS),
     lambda v, c, r: hf.MinNewTokensLengthLogitsProcessor(PROMPT_LENS[r], v, EOS)),
    ("forced_bos", [5, None, 9, 2], ForcedBOSTokenLogitsProcessor,
     lambda v, c, r: hf.ForcedBOSTokenLogitsProcessor(v)),
    ("forced_eos", [15, None, 30, 21], lambda v: ForcedEOSTokenLogitsProcessor(v, EOS),
     lambda v, c, r: hf.ForcedEOSTokenLogitsProcessor(v, EOS)),
    ("exp_decay", [(2, 1.3), None, (0, 0.8), (1, 1.1)], lambda v: ExponentialDecayLengthPenalty.from_config(v, EOS),
     lambda v, c, r: hf.ExponentialDecayLengthPenalty(v, EOS, PROMPT_LENS[r])),
    # Rows that end on different EOS ids (continuous batching: eos_token_id per request).
    ("min_length_eos", [(12, [3]), None, (5, [7, 9]), (22, [9])], lambda v: MinLengthLogitsProcessor(*v),
     lambda v, c, r: hf.MinLengthLogitsProcessor(*v)),
    ("min_new_tokens_eos", [(7, [3, 7]), (2, [9]), (1, [7]), None], lambda v: MinNewTokensLengthLogitsProcessor(None, *v),
     lambda v, c, r: hf.MinNewTokensLengthLogitsProcessor(PROMPT_LENS[r], *v)),
    ("forced_eos_eos", [(15, [3]), (9, [5, 7]), None, (21, [9, 3])], lambda v: ForcedEOSTokenLogitsProcessor(*v),
     lambda v, c, r: hf.ForcedEOSTokenLogitsProcessor(*v)),
    ("exp_decay_eos", [((2, 1.3), [3]), None, ((0, 0.8), [7, 9]), ((1, 1.1), [9])],
     lambda v: ExponentialDecayLengthPenalty.from_config(*v),
     lambda v, c, r: hf.ExponentialDecayLengthPenalty(v[0], v[1], PROMPT_LENS[r])),
    ("suppress", [(1, 4, 9), None, (2,), (4, 11)], SuppressTokensLogitsProcessor,
     lambda v, c, r: hf.SuppressTokensLogitsProcessor(list(v))),
    ("begin_suppress", [(2, 3), (5, 2), None, (2,)], SuppressTokensAtBeginLogitsProcessor,
     lambda v, c, r: hf.SuppressTokensAtBeginLogitsProcessor(list(v), PROMPT_LENS[r])),
    ("inf_nan", [True, None, True, None], lambda v: InfNanRemoveLogitsProcessor(),
     lambda v, c, r: hf.InfNanRemoveLogitsProcessor()),
    ("normalize", [None, True, True, None], lambda v: LogitNormalization(), lambda v, c, r: hf.LogitNormalization()),
    ("watermark", [2.0, None, 1.0, 3.0], lambda v: WatermarkLogitsProcessor.create(V, bias=v),
     lambda v, c, r: hf.WatermarkLogitsProcessor(V, "cpu", bias=v)),
]
KIND_IDS = [k[0] for k in KINDS]


def expected_rows(kind, ctx, logits, values=None):
    name, default_values, _, theirs = kind
    values = default_values if values is None else values
    out = []
    for row, value in enumerate(values):
        if value is None:
            out.append(logits[row : row + 1])
        else:
            out.append(theirs(value, ctx, row)(row_ids(ctx, row), logits[row : row + 1].clone()))
    return torch.cat(out)


def assert_rows_equal(got, want, name):
    for row in range(got.shape[0]):
        torch.testing.assert_close(got[row], want[row], atol=1e-6, rtol=0, equal_nan=True,
                                   msg=lambda m: f"{name}, row {row}: {m}")


@pytest.mark.parametrize("name", KIND_IDS)
def test_scalar_processor_on_rows_at_their_own_lengths(name):
    """One value for the batch, lengths per row: every row equals transformers on its input_ids."""
    kind = next(k for k in KINDS if k[0] == name)
    ctx, logits = rows_batch(1)
    value = next(v for v in kind[1] if v is not None)
    ours = kind[2](value)
    assert_rows_equal(ours(logits.clone(), ctx), expected_rows(kind, ctx, logits, [value] * 4), name)


@pytest.mark.parametrize("name", KIND_IDS)
@pytest.mark.parametrize("seed", [2, 3])
def test_per_row_values_match_transformers_per_request(name, seed):
    """Rows with their own values, and rows without the kind, merged into one batch processor."""
    kind = next(k for k in KINDS if k[0] == name)
    ctx, logits = rows_batch(seed)
    row_chains = [ProcessorChain(() if v is None else (kind[2](v),)) for v in kind[1]]
    batch = ProcessorChain.merge_rows(row_chains)
    assert len(batch) == 1
    got = batch(logits.clone(), ctx)
    assert_rows_equal(got, expected_rows(kind, ctx, logits), name)
    # The scalar chain of one request, made per row, computes the same as the scalar one.
    value = next(v for v in kind[1] if v is not None)
    scalar = ProcessorChain((kind[2](value),))
    torch.testing.assert_close(scalar.per_row(4)(logits.clone(), ctx), scalar(logits.clone(), ctx),
                               atol=0, rtol=0, equal_nan=True)


def test_per_row_chain_has_only_tensor_leaves_and_one_structure():
    ctx, logits = rows_batch(0)

    def batch_chain(values_shift: float):
        rows = []
        for r in range(4):
            ps = []
            for name, values, make, _ in KINDS:
                v = values[r]
                if v is None or name.endswith("_eos") or name in ("inf_nan", "normalize", "top_k_keep", "top_p_keep",
                                                                  "no_repeat_mixed"):
                    continue  # one processor per kind; these two are masked, not valued
                if isinstance(v, float):
                    v = v * values_shift if name not in ("top_p", "top_p_keep", "min_p", "typical", "epsilon",
                                                         "eta", "top_h") else v / (1 + values_shift)
                ps.append(make(v))
            rows.append(ProcessorChain(tuple(ps)))
        return ProcessorChain.merge_rows(rows)

    a, b = batch_chain(1.0), batch_chain(1.3)
    leaves_a, spec_a = torch_pytree.tree_flatten(a)
    leaves_b, spec_b = torch_pytree.tree_flatten(b)
    assert spec_a == spec_b
    # No numbers are left as Python leaves (they would be baked into a compiled step); None marks
    # an optional table that is absent, which is structure, like the state's own optional buffers.
    assert all(isinstance(x, torch.Tensor) or x is None for x in leaves_a), [
        type(x) for x in leaves_a if not isinstance(x, torch.Tensor)]
    assert [x is None for x in leaves_a] == [x is None for x in leaves_b]
    assert a.fingerprint() == b.fingerprint()
    assert a.content_key() != b.content_key()
    assert not torch.equal(a(logits, ctx).nan_to_num(), b(logits, ctx).nan_to_num())
    # A chain of other kinds has another structure.
    assert ProcessorChain(a.processors[:-1]).fingerprint() != a.fingerprint()


def test_user_built_processors_keep_transformers_values():
    assert TemperatureLogitsWarper(0.7).temperature == 0.7
    assert TopKLogitsWarper(5).top_k == 5
    assert TopPLogitsWarper(0.9).top_p == 0.9
    assert RepetitionPenaltyLogitsProcessor(1.3).penalty == 1.3
    assert NoRepeatNGramLogitsProcessor(3).ngram_size == 3
    assert MinNewTokensLengthLogitsProcessor(None, 4, EOS).min_new_tokens == 4
    per_row = ProcessorChain((TemperatureLogitsWarper(0.7), TopKLogitsWarper(5))).per_row(3)
    assert per_row[0].temperature.shape == (3,) and per_row[0].temperature.dtype == torch.float32
    assert per_row[1].top_k.tolist() == [5, 5, 5] and per_row[1].top_k.dtype == torch.int64


def test_with_row_replaces_one_row_only():
    ctx, logits = rows_batch(5)
    configs = [
        dict(temperature=0.5, top_k=4, suppress=(1, 4), bias={(4,): 2.5}, ngram=2),
        dict(temperature=1.5, top_k=None, suppress=None, bias={(2, 3): 3.0}, ngram=None),
        dict(temperature=None, top_k=9, suppress=(9,), bias=None, ngram=3),
        dict(temperature=0.8, top_k=2, suppress=(4,), bias={(1, 2): -1.0}, ngram=1),
    ]

    def chain(c):
        ps = []
        if c["temperature"] is not None:
            ps.append(TemperatureLogitsWarper(c["temperature"]))
        if c["ngram"] is not None:
            ps.append(NoRepeatNGramLogitsProcessor(c["ngram"]))
        if c["bias"] is not None:
            ps.append(SequenceBiasLogitsProcessor.create(c["bias"]))
        if c["suppress"] is not None:
            ps.append(SuppressTokensLogitsProcessor(c["suppress"]))
        if c["top_k"] is not None:
            ps.append(TopKLogitsWarper(c["top_k"]))
        return ProcessorChain(tuple(ps))

    batch = ProcessorChain.merge_rows([chain(c) for c in configs])
    newcomer = dict(temperature=2.0, top_k=None, suppress=(9, 1), bias={(1, 2): 0.5}, ngram=3)
    row = ProcessorChain.merge_rows([chain(newcomer)], like=batch)
    swapped = batch.with_row(1, row)
    assert torch_pytree.tree_flatten(swapped)[1] == torch_pytree.tree_flatten(batch)[1]
    want = ProcessorChain.merge_rows([chain(c) for c in (configs[0], newcomer, configs[2], configs[3])])
    got = swapped(logits.clone(), ctx)
    torch.testing.assert_close(got, want(logits.clone(), ctx), atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(got[[0, 2, 3]], batch(logits.clone(), ctx)[[0, 2, 3]], atol=0, rtol=0)
    # A tensor slot works too (the insert of a compiled step).
    got_t = batch.with_row(torch.tensor(1), row)(logits.clone(), ctx)
    torch.testing.assert_close(got_t, got, atol=0, rtol=0)
    # A row with a kind or a table the batch does not hold is refused, naming it.
    with pytest.raises(ValueError, match="MinPLogitsWarper"):
        ProcessorChain.merge_rows([ProcessorChain((MinPLogitsWarper(0.1),))], like=batch)
    with pytest.raises(ValueError, match="suppress_tokens"):
        ProcessorChain.merge_rows([chain({**newcomer, "suppress": (13,)})], like=batch)
    with pytest.raises(ValueError, match="exceeds"):
        ProcessorChain.merge_rows([chain({**newcomer, "ngram": 5})], like=batch)


def test_rows_that_disagree_on_a_static_setting_are_refused():
    with pytest.raises(ValueError, match="min_tokens_to_keep"):
        ProcessorChain.merge_rows([ProcessorChain((TopKLogitsWarper(3),)),
                                   ProcessorChain((TopKLogitsWarper(3, min_tokens_to_keep=2),))])
    with pytest.raises(ValueError, match="order"):
        ProcessorChain.merge_rows([ProcessorChain((TopKLogitsWarper(3), TopPLogitsWarper(0.5))),
                                   ProcessorChain((TopPLogitsWarper(0.5), TopKLogitsWarper(3)))])
    synthid = SynthIDTextWatermarkLogitsProcessor.create(ngram_len=2, keys=[1, 2])
    with pytest.raises(ValueError, match="state"):
        ProcessorChain.merge_rows([ProcessorChain((synthid,)), ProcessorChain(())])


def test_kinds_without_an_off_value_are_row_masked():
    ctx, logits = rows_batch(6)
    logits[1, 5] = math.nan
    logits[2, 6] = math.inf
    batch = ProcessorChain.merge_rows([ProcessorChain((InfNanRemoveLogitsProcessor(),)), ProcessorChain(()),
                                       ProcessorChain((InfNanRemoveLogitsProcessor(),)), ProcessorChain(())])
    assert isinstance(batch[0], RowSelect)
    out = batch(logits.clone(), ctx)
    assert torch.isnan(out[1, 5]) and torch.isfinite(out[2]).all() and torch.isfinite(out[0, 4:]).all()


# ---------------------------------------------------------------------------------------------
# one compiled step for every value


def test_per_row_chain_compiles_once_for_ten_value_sets():
    from torch._dynamo.testing import CompileCounter

    ctx, logits = rows_batch(7)
    g = torch.Generator().manual_seed(0)

    def draw(lo, hi):
        return lo + (hi - lo) * float(torch.rand((), generator=g))

    def value_set():
        rows = []
        for _ in range(4):
            rows.append(ProcessorChain((
                RepetitionPenaltyLogitsProcessor(draw(0.5, 2.0)),
                # The n-gram size is per row under a static maximum (it sets the number of comparisons).
                NoRepeatNGramLogitsProcessor(int(torch.randint(1, 4, (), generator=g)), max_ngram_size=3),
                MinNewTokensLengthLogitsProcessor(None, int(torch.randint(0, 12, (), generator=g)) or 1, EOS),
                ExponentialDecayLengthPenalty.from_config((int(torch.randint(0, 4, (), generator=g)),
                                                           draw(0.8, 1.5)), EOS),
                TemperatureLogitsWarper(draw(0.3, 2.0)),
                TopKLogitsWarper(int(torch.randint(1, 40, (), generator=g))),
                TopPLogitsWarper(draw(0.3, 0.99)),
                MinPLogitsWarper(draw(0.0, 0.2)),
                TypicalLogitsWarper(draw(0.3, 0.99)),
                EpsilonLogitsWarper(draw(1e-4, 0.05)),
                EtaLogitsWarper(draw(1e-4, 0.05)),
                TopHLogitsWarper(draw(0.2, 1.0)),
                # Tables shared by the batch, numbers per row.
                SequenceBiasLogitsProcessor.create({(4,): draw(-3, 3), (1, 2): draw(-3, 3)}),
                MinLengthLogitsProcessor(int(torch.randint(0, 20, (), generator=g)), EOS),
                ForcedEOSTokenLogitsProcessor(int(torch.randint(2, 22, (), generator=g)), EOS),
                ForcedBOSTokenLogitsProcessor(int(torch.randint(0, V, (), generator=g))),
                WatermarkLogitsProcessor.create(V, bias=draw(0.5, 3.0), precompute_greenlists=True),
            )))
        return ProcessorChain.merge_rows(rows, like=None)

    first = value_set()
    _, spec = torch_pytree.tree_flatten((ctx, first.per_row(4)))

    def step(logits, *leaves):
        c, chain = torch_pytree.tree_unflatten(list(leaves), spec)
        return chain(logits, c)

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    chain = first
    for i in range(10):
        if i:
            chain = value_set()
        leaves, this_spec = torch_pytree.tree_flatten((ctx, chain))
        assert this_spec == spec and chain.fingerprint() == first.fingerprint()
        torch.testing.assert_close(compiled(logits, *leaves), chain(logits, ctx), atol=0, rtol=0, equal_nan=True)
    assert counter.frame_count == 1


# ---------------------------------------------------------------------------------------------
# build_logits_processors_for_rows against transformers' _get_logits_processor per request


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=3,
                         pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def hf_config(prompt_len: int, **kwargs):
    from transformers import GenerationConfig

    config = GenerationConfig(**kwargs)
    config.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    config.max_length = prompt_len + (config.max_new_tokens or 20)
    if config.min_new_tokens is not None:
        config.min_length = config.min_new_tokens + prompt_len
    config._eos_token_tensor = torch.tensor([3])
    return config


ROW_CONFIGS = [
    dict(do_sample=True, temperature=0.7, top_k=5, repetition_penalty=1.3, no_repeat_ngram_size=2),
    dict(do_sample=True, top_p=0.8, top_k=0, min_new_tokens=3, suppress_tokens=[9, 10]),
    dict(do_sample=True, min_p=0.05, bad_words_ids=[[4], [1, 2]], sequence_bias={(6,): 1.5}, renormalize_logits=True),
    dict(do_sample=False, repetition_penalty=0.7, exponential_decay_length_penalty=(1, 1.5),
         begin_suppress_tokens=[11], forced_eos_token_id=[3, 8], max_new_tokens=7),
]


def test_rows_built_from_configs_match_transformers(tiny_llama):
    ctx, logits = rows_batch(8, token_range=12)
    configs = [hf_config(PROMPT_LENS[r], **ROW_CONFIGS[r]) for r in range(4)]
    ours = build_logits_processors_for_rows(
        configs, prompt_len=PROMPT_LENS, max_length=[c.max_length for c in configs],
        min_length=[c.min_length for c in configs], eos_token_ids=[3], vocab_size=V)
    got = ours(logits.clone(), ctx)
    for row, config in enumerate(configs):
        theirs = tiny_llama._get_logits_processor(
            generation_config=config, input_ids_seq_length=PROMPT_LENS[row], encoder_input_ids=prompt_ids(ctx, row),
            logits_processor=hf.LogitsProcessorList(), device="cpu", model_kwargs={})
        want = theirs(row_ids(ctx, row), logits[row : row + 1].clone())
        torch.testing.assert_close(got[row], want[0], atol=1e-5, rtol=0, equal_nan=True, msg=lambda m: f"row {row}: {m}")
    # A newcomer for row 2, built like the batch, swaps in.
    config = hf_config(PROMPT_LENS[2], do_sample=True, temperature=1.4, top_k=7)
    row = build_logits_processors_for_rows([config], prompt_len=PROMPT_LENS[2], max_length=config.max_length,
                                           min_length=config.min_length, eos_token_ids=[3], vocab_size=V, like=ours)
    swapped = ours.with_row(2, row)(logits.clone(), ctx)
    theirs = tiny_llama._get_logits_processor(
        generation_config=config, input_ids_seq_length=PROMPT_LENS[2], encoder_input_ids=prompt_ids(ctx, 2),
        logits_processor=hf.LogitsProcessorList(), device="cpu", model_kwargs={})
    torch.testing.assert_close(swapped[2], theirs(row_ids(ctx, 2), logits[2:3].clone())[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(swapped[[0, 1, 3]], got[[0, 1, 3]], atol=0, rtol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# transformers-style callables in logits_processor=


def shared_len_batch(seed: int = 9):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (3, 16), generator=g)
    logits = torch.randn((3, V), generator=g)
    ctx = LogitsContext(tokens=tokens, cur_len=torch.tensor([10, 10, 10]), prompt_len=torch.tensor([6, 6, 6]))
    return ctx, logits, tokens[:, :10].clone()


def test_transformers_processors_run_inside_a_genfn_chain():
    ctx, logits, input_ids = shared_len_batch()
    config = hf_config(6, do_sample=True, top_k=5, temperature=0.9)
    user = hf.LogitsProcessorList([hf.SuppressTokensLogitsProcessor([2, 5]), hf.TopKLogitsWarper(3),
                                   lambda ids, scores: scores - ids.shape[1]])
    ours = build_logits_processors(config, prompt_len=6, max_length=26, min_length=0, eos_token_ids=[3],
                                   user_processors=user)
    assert not ours.compile_safe
    assert sum(isinstance(p, ExternalLogitsProcessor) for p in ours) == 3
    # transformers' order: custom non-warpers after the defaults, and its TopK takes TopK's slot.
    want = logits.clone()
    for p in (user[0], user[2], hf.TemperatureLogitsWarper(0.9), user[1]):
        want = p(input_ids, want)
    torch.testing.assert_close(ours(logits.clone(), ctx), want, atol=1e-6, rtol=0)
    # A single callable, not in a list, is accepted too.
    single = build_logits_processors(hf_config(6), prompt_len=6, max_length=26, min_length=0, eos_token_ids=[3],
                                     user_processors=hf.SuppressTokensLogitsProcessor([1]))
    assert torch.isneginf(single(logits.clone(), ctx)[:, 1]).all()


def test_external_callables_are_checked():
    ctx, logits, _ = shared_len_batch()

    def returns_list(ids, scores):
        return scores.tolist()

    def wrong_shape(ids, scores):
        return scores[:, :-1]

    with pytest.raises(TypeError, match="returns_list"):
        ExternalLogitsProcessor.wrap(returns_list)(logits, ctx)
    with pytest.raises(TypeError, match="wrong_shape"):
        ExternalLogitsProcessor.wrap(wrong_shape)(logits, ctx)
    uneven = ctx.replace(cur_len=torch.tensor([10, 9, 10]))
    with pytest.raises(ValueError, match="same length"):
        ExternalLogitsProcessor.wrap(lambda ids, scores: scores)(logits, uneven)
    with pytest.raises(TypeError, match="logits_processor"):
        build_logits_processors(hf_config(6), prompt_len=6, max_length=26, min_length=0, eos_token_ids=[3],
                                user_processors=[42])
    # The callable sees copies: writing into them leaves genfn's buffers alone.
    tokens = ctx.tokens.clone()

    def scribbles(ids, scores):
        ids.zero_()
        scores.zero_()
        return scores

    ExternalLogitsProcessor.wrap(scribbles)(logits, ctx)
    assert torch.equal(ctx.tokens, tokens) and logits.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# token ids in arguments are range-checked


@pytest.mark.parametrize("setting,name", [
    (dict(forced_bos_token_id=V), "forced_bos_token_id"),
    (dict(forced_eos_token_id=[3, V + 2]), "forced_eos_token_id"),
    (dict(suppress_tokens=[1, V]), "suppress_tokens"),
    (dict(begin_suppress_tokens=[V + 5]), "begin_suppress_tokens"),
    (dict(bad_words_ids=[[1], [2, V]]), "bad_words_ids"),
    (dict(sequence_bias={(V, 1): 1.0}), "sequence_bias"),
])
def test_out_of_vocabulary_ids_name_their_argument(setting, name):
    config = hf_config(6, **setting)
    with pytest.raises(ValueError, match=name):
        build_logits_processors(config, prompt_len=6, max_length=26, min_length=0, eos_token_ids=[3], vocab_size=V)


def test_prefix_allowed_tokens_fn_answers_are_checked():
    ctx, logits, _ = shared_len_batch()
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn"):
        PrefixConstrainedLogitsProcessor(lambda b, ids: [1, V])(logits, ctx)
    with pytest.raises(TypeError, match="prefix_allowed_tokens_fn"):
        PrefixConstrainedLogitsProcessor(lambda b, ids: 3)(logits, ctx)
    # A tensor answer is fine; rows may stand at different lengths.
    uneven = ctx.replace(cur_len=torch.tensor([10, 4, 7]))
    seen = []

    def allowed(batch_id, ids):
        seen.append(ids.shape[0])
        return torch.tensor([1, 2])

    out = PrefixConstrainedLogitsProcessor(allowed)(logits, uneven)
    assert seen == [10, 4, 7]
    assert torch.isfinite(out[:, 1:3]).all() and torch.isneginf(out[:, 3:]).all()


def test_synthid_rows_count_their_own_steps():
    """A row that joins a running batch (fresh SynthID state in its slot) is watermarked exactly as
    the same request alone."""
    processor = SynthIDTextWatermarkLogitsProcessor.create(ngram_len=3, keys=[654, 400, 836], context_history_size=4)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 6, (2, 12), generator=g)
    state = processor.init_state(2)
    for t in range(4, 7):
        ctx = LogitsContext(tokens=tokens, cur_len=torch.tensor([t, t]), prompt_len=torch.tensor([4, 4]))
        _, state = processor.apply(torch.randn((2, V), generator=g), ctx, state)
    fresh = processor.init_state(1)
    joined = type(state)(
        context=torch.cat([state.context[:1], fresh.context]),
        context_history=torch.cat([state.context_history[:1], fresh.context_history]),
        num_calls=torch.cat([state.num_calls[:1], fresh.num_calls]),
    )
    newcomer = torch.randint(0, 6, (1, 12), generator=g)
    both = torch.cat([tokens[:1], newcomer])
    alone_state = fresh
    for step in range(3):
        logits = torch.randn((2, V), generator=g)
        ctx = LogitsContext(tokens=both, cur_len=torch.tensor([7 + step, 3 + step]), prompt_len=torch.tensor([4, 3]))
        got, joined = processor.apply(logits.clone(), ctx, joined)
        alone_ctx = LogitsContext(tokens=newcomer, cur_len=torch.tensor([3 + step]), prompt_len=torch.tensor([3]))
        want, alone_state = processor.apply(logits[1:].clone(), alone_ctx, alone_state)
        torch.testing.assert_close(got[1:], want, atol=0, rtol=0)
    assert joined.num_calls.tolist() == [6, 3]


def test_package_exports_everything_it_documents():
    import genfn.processors as P

    for name in P.__all__:
        assert hasattr(P, name), name
    for name in ("ProcessorBase", "ExternalLogitsProcessor", "RowSelect", "RowValue",
                 "build_logits_processors_for_rows"):
        assert name in P.__all__


@pytest.mark.parametrize("ids", [(3,), (1, 5, 7), (5, 5, 2), ()])
@pytest.mark.parametrize("with_rows", [False, True])
@pytest.mark.parametrize("with_active", [False, True])
def test_forbidding_ids_touches_only_the_forbidden_entries(ids, with_rows, with_active):
    from genfn.processors.forcing import _forbid_ids

    gen = torch.Generator().manual_seed(len(ids) + 2 * with_rows + 4 * with_active)
    logits = torch.randn(6, 11, generator=gen)
    before = logits.clone()
    row_mask = torch.rand(6, len(ids), generator=gen) < 0.5 if with_rows else None
    active = torch.rand(6, 1, generator=gen) < 0.5 if with_active else None
    out = _forbid_ids(logits, ids, "eos_token_id", row_mask, active)
    expected = logits.clone()
    for b in range(6):
        for j, token in enumerate(ids):
            if (row_mask is None or row_mask[b, j]) and (active is None or active[b, 0]):
                expected[b, token] = -math.inf
    assert torch.equal(out, expected)
    assert torch.equal(logits, before)  # pure: the input is not written
    with pytest.raises(ValueError, match="eos_token_id"):
        _forbid_ids(logits, (11,), "eos_token_id", None, None)
