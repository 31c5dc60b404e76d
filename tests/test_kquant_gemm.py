"""The K-quant GEMM (``kquant_gemm.cpp``: Q4_K/Q5_K/Q6_K/IQ4_XS products of many rows): against the float64
reference at odd sizes and row counts, its AVX2 and AVX-512 paths against each other, every row's
bits independent of the rows beside it, the hand-over from the row kernels, and a Q4_K_M-like
model whose prefill runs through it."""

from __future__ import annotations

import pytest
import torch

import genfn
from conftest import tiny_hf_model
from genfn import kernels
from genfn.kernels import kquant
from genfn.quant import quantize_k, reference_linear_k
from test_kquants import isa, write_kquant_gguf  # noqa: F401  (isa: the ISA-path fixture)

FORMATS = ("q4_k", "q5_k", "q6_k", "iq4_xs", "iq4_nl")
NATIVE = kquant.kquant_available()
pytestmark = pytest.mark.skipif(not NATIVE, reason=f"the K-quant kernels are {kquant.kquant_status()}")


@pytest.fixture
def gemm_rows():
    """``gemm_min_rows`` for the test's body, the default restored after it."""
    yield kquant.gemm_min_rows
    kquant.gemm_min_rows(None)


def _skip_without_a_second_path():
    """The AVX2-against-AVX-512 tests compare two paths; a CPU without AVX-512 has only the AVX2 one, which
    the ``isa`` fixture's tests still run there."""
    if torch.ops.genfn_kquant.kquant_isa() < 2:
        pytest.skip("this CPU has no AVX-512: only the AVX2 kernels run here (the isa-parametrized tests run "
                    "them), there is no second path to compare them with")


def _problem(fmt: str, out_features: int, in_features: int, rows: int, seed: int = 0):
    torch.manual_seed(seed)
    weight = quantize_k(torch.randn(out_features, in_features), fmt)
    x = torch.randn(rows, in_features) * 3
    x[1, :256] = 0  # a super-block of zeros: activation scale 0
    x[2, 256:512] *= 1e3  # one large block beside small ones
    return weight, x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_features,in_features", [(37, 512), (130, 1280)])
def test_gemm_matches_the_reference_at_odd_sizes_and_row_counts(isa, gemm_rows, fmt, out_features, in_features):
    """Tolerance: the super-blocks' integer sums are exact; only the float32 sums over them and the
    scale products round, so the result is the float64 reference's within 1e-5 of its largest value."""
    weight, x = _problem(fmt, out_features, in_features, 512)
    expected = reference_linear_k(x, weight)
    gemm_rows(1)  # every row count through the GEMM
    for rows in (1, 7, 33, 64, 512):
        y = kernels.linear(x[:rows], weight)
        torch.testing.assert_close(y, expected[:rows], rtol=1e-5, atol=1e-5 * expected[:rows].abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS)
def test_avx2_and_avx512_gemms_give_the_same_bits(gemm_rows, fmt):
    _skip_without_a_second_path()
    weight, x = _problem(fmt, 45, 768, 70)
    gemm_rows(1)
    try:
        # The same integer per super-block and the same float32 operations per output, in the same order.
        results = {path: (kquant.force_isa(path), kernels.linear(x, weight))[1] for path in ("avx512", "avx2")}
    finally:
        kquant.force_isa(None)
    assert torch.equal(results["avx512"], results["avx2"])


@pytest.mark.parametrize("fmt", [*FORMATS, "q4_k_r8", "q6_k_r8", "iq4_xs_r8"])
def test_avx2_and_avx512_row_kernels_give_the_same_bits(fmt):
    """The row kernels (a decode step, a few drafts; 13 rows: a call of eight and one of five) add each
    block's exact integer into an output in one order on both paths (add_block; IQ4_NL's eight lanes),
    so a machine's ISA does not change a row's bits. (IQ4 summed its own vector lanes, 16 on AVX-512 and
    8 on AVX2, until session 42 gave it the GEMMs' orders.)"""
    _skip_without_a_second_path()
    from genfn.quant.kquants import repack_r8

    # 1184 inputs: IQ4_NL's 37 blocks are four groups of eight, a group of four, one block alone.
    weight, x = _problem(fmt.removesuffix("_r8"), 40, 1184 if fmt == "iq4_nl" else 768, 13)
    if fmt.endswith("_r8"):
        weight = repack_r8(weight)
    try:
        for rows in (1, 2, 3, 5, 8, 13):
            results = {path: (kquant.force_isa(path), kernels.kquant_linear(x[:rows], weight, row_kernels=True))[1]
                       for path in ("avx512", "avx2")}
            assert torch.equal(results["avx512"], results["avx2"]), rows
    finally:
        kquant.force_isa(None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_row_has_its_bits_whatever_rows_come_with_it(isa, gemm_rows, fmt):
    weight, x = _problem(fmt, 40, 512, 80)
    gemm_rows(1)
    whole = kernels.linear(x, weight)
    for start, stop in ((0, 1), (0, 16), (3, 20), (5, 38), (41, 80)):
        assert torch.equal(kernels.linear(x[start:stop], weight), whole[start:stop]), (start, stop)


def test_the_gemm_takes_over_from_the_row_kernels_at_gemm_min_rows(gemm_rows):
    weight, x = _problem("q4_k", 130, 1280, 16)
    assert gemm_rows(None) == 16
    rows_15, rows_16 = kernels.linear(x[:15], weight), kernels.linear(x, weight)
    gemm_rows(10**9)
    row_kernels = kernels.linear(x, weight)
    gemm_rows(1)
    gemm = kernels.linear(x, weight)
    assert torch.equal(rows_15, row_kernels[:15]) and torch.equal(rows_16, gemm)
    assert torch.equal(gemm, row_kernels)  # one order of the float sums (next test)
    # row_kernels=True (the batch-invariant mode's) keeps every row count on the row kernels.
    assert torch.equal(kernels.kquant_linear(x, weight, row_kernels=True), row_kernels)


@pytest.mark.parametrize("fmt", [*FORMATS, "q4_k_r8", "q5_k_r8", "q6_k_r8", "iq4_xs_r8"])
def test_the_gemm_and_the_row_kernels_give_an_output_the_same_bits(isa, gemm_rows, fmt):
    """Every K-quant kernel adds a super-block's integer sums into its float32 output in one order
    (kquant.h's add_block), so a row's outputs have the same bits through the GEMM (a prefill, a
    batch of 16 rows and more) as through the row kernels of one row (a decode step) or eight."""
    from genfn.quant.kquants import repack_r8

    # 11 super-blocks: eight, then three; IQ4_NL's 37 blocks of 32: four groups of eight lanes, four, one.
    weight, x = _problem(fmt.removesuffix("_r8"), 48, 1184 if fmt == "iq4_nl" else 2816, 40)
    if fmt.endswith("_r8"):
        weight = repack_r8(weight)
    gemm_rows(1)
    gemm = kernels.linear(x, weight)
    gemm_rows(10**9)
    alone = torch.cat([kernels.linear(x[i:i + 1], weight) for i in range(x.shape[0])])
    assert torch.equal(gemm, alone)
    assert torch.equal(kernels.linear(x[3:11], weight), alone[3:11])  # eight rows a call
    assert torch.equal(kernels.linear(x[5:10], weight), alone[5:10])


# Where each format's code bytes lie in its 256-input super-block (ggml's layout): Q4_K qs, Q5_K qh and
# qs, Q6_K ql and qh. All ones there make every code the format's largest (15, 31, 63).
_CODE_BYTES = {"q4_k": (16, 144), "q5_k": (16, 176), "q6_k": (0, 192)}


@pytest.mark.parametrize("fmt", sorted(_CODE_BYTES))
def test_the_gemm_is_exact_where_its_16_bit_sums_are_at_their_bounds(isa, gemm_rows, fmt):
    """The AVX2 GEMM sums several steps' vpmaddubsw pairs in 16 bits before its multiply by the
    sub-block scale (Q4_K eight steps, Q5_K four, Q6_K two): with every weight code the format's
    largest and every activation code at 127 in magnitude, those sums reach 30480, 31496 and
    32004. They must not wrap: the GEMM's rows equal the row kernels' and the float64 reference."""
    weight, _ = _problem(fmt, 24, 512, 3)
    start, end = _CODE_BYTES[fmt]
    data = weight.data.clone().view(24, 2, -1)  # [rows, super-blocks, bytes]
    data[:, :, start:end] = 0xFF
    weight = type(weight).from_bytes(data.reshape(24, -1), fmt, (24, 512))
    x = torch.full((20, 512), 2.5)
    x[1::2] *= -1
    gemm_rows(1)
    gemm = kernels.linear(x, weight)
    gemm_rows(10**9)
    assert torch.equal(gemm, kernels.linear(x, weight))
    expected = reference_linear_k(x, weight)
    torch.testing.assert_close(gemm, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_gemm_min_rows_rejects_what_is_not_a_row_count():
    for bad in (0, -3, 2.5, "16", True):
        with pytest.raises(ValueError, match="rows must be None or a positive int"):
            kquant.gemm_min_rows(bad)


def test_a_k_quant_models_prefill_through_the_gemm_keeps_its_greedy_tokens(tmp_path, gemm_rows):
    """A Q4_K_M-like file (Q4_K, Q5_K and Q6_K matrices) and a 40-token prompt: the prefill's
    products run through the GEMM; the greedy tokens are the row kernels' and the reference's."""
    hf, _ = tiny_hf_model(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_kquant_gguf(path, hf)
    model = genfn.load(path, quantize="gguf")
    prompt = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, return_dict_in_generate=True,
              output_logits=True, disable_compile=True)
    gemm_rows(None)
    gemm = genfn.generate(model, prompt, **kw)
    gemm_rows(10**9)
    rows = genfn.generate(model, prompt, **kw)
    original = kernels.kquant_linear
    try:
        kernels.kquant_linear = lambda x, weight, **_: reference_linear_k(x, weight)
        reference = genfn.generate(model, prompt, **kw)
    finally:
        kernels.kquant_linear = original
    assert torch.equal(gemm.sequences, rows.sequences) and torch.equal(gemm.sequences, reference.sequences)
    for other in (rows, reference):
        torch.testing.assert_close(torch.stack(gemm.logits), torch.stack(other.logits), rtol=1e-4, atol=1e-4)
