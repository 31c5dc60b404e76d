"""The compiled decode step: compiled once, reused by every call, and token-identical to eager."""

import pytest
import torch
from torch._dynamo.utils import counters

import genfn
from conftest import tiny_pair


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_ten_calls_compile_the_decode_step_once():
    _, model = tiny_pair(eos_token_id=None)
    gen = torch.Generator().manual_seed(0)
    before = _graphs()
    for i, (prompt_len, new_tokens) in enumerate([(3, 5), (9, 30), (17, 60), (4, 100), (30, 12), (2, 2),
                                                  (50, 70), (7, 7), (64, 64), (11, 1)]):
        ids = torch.randint(3, 97, (2, prompt_len), generator=gen)
        out = genfn.generate(model, ids, max_new_tokens=new_tokens, cache_implementation="static", max_cache_len=160)
        assert torch.equal(out, genfn.generate(model, ids, max_new_tokens=new_tokens)), f"call {i}"
    assert _graphs() - before == 1
    assert len(model.compiled_steps) == 1
    # The compiled step's linears (batch 2: two rows) run genfn's decode kernel where it is built.
    from genfn import kernels

    with torch.profiler.profile() as profile:
        genfn.generate(model, ids, max_new_tokens=3, cache_implementation="static", max_cache_len=160)

    def calls(op):
        return sum(e.count for e in profile.key_averages() if e.key == f"genfn_kernels::{op}")

    # Two compiled steps, each its whole stack of layers in one native call (genfn.kernels.decode_layer's
    # run_stack) and the LM head through the decode kernel; the eager prefill (22 rows, past the fused
    # layer's 16 tokens) runs its four linears a layer op by op, through the decode kernel's panels
    # (at most MAX_LINEAR_ROWS rows), and its LM head on the last position of each row.
    built = kernels.decode_linear_available()
    assert calls("decode_linear") == (2 + 1 + 4 * model.spec.num_layers if built else 0)
    assert calls("decode_stack") == (2 if built else 0)
    assert calls("decode_attention_input") == calls("decode_layer_output") == 0


def test_a_run_that_fills_its_cache_compiles_the_step_once():
    # max_cache_len defaults to prompt + new tokens: the attention span grows from 32 slots to the
    # whole capacity (41) within the run. That edge once recompiled the step (a slice that is the
    # whole buffer is contiguous, and inductor guards on it).
    _, model = tiny_pair(eos_token_id=None)
    ids = torch.randint(3, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    before = _graphs()
    out = genfn.generate(model, ids, max_new_tokens=20, cache_implementation="static")
    assert _graphs() - before == 1
    assert torch.equal(out, genfn.generate(model, ids, max_new_tokens=20))


def test_a_loop_trusts_guards_only_where_checking_them_recompiles_nothing(monkeypatch):
    """From a loop's second compiled step the driver asks dynamo for the differentiating guards only.
    That is sound only if every guard it skips would have passed: the same run that grows its span
    to the whole cache, with every guard checked, compiles once and gives the same tokens."""
    import contextlib

    import genfn.driver as driver

    _, model = tiny_pair(eos_token_id=None, seed=3)
    ids = torch.randint(3, 97, (2, 21), generator=torch.Generator().manual_seed(2))
    trusted = []
    real = driver._trusted_guards
    monkeypatch.setattr(driver, "_trusted_guards", lambda flag: trusted.append(flag) or real(flag))
    fast = genfn.generate(model, ids, max_new_tokens=20, cache_implementation="static")
    assert len(trusted) == 18 and all(trusted)  # 19 compiled steps (init chose the first token): all but the first
    monkeypatch.setattr(driver, "_trusted_guards", lambda flag: contextlib.nullcontext())
    before = _graphs()
    checked = genfn.generate(model, ids, max_new_tokens=20, cache_implementation="static")
    assert _graphs() == before  # no guard failed: the compiled step was reused as it was
    assert torch.equal(fast, checked)
    assert torch.equal(fast, genfn.generate(model, ids, max_new_tokens=20))


def test_a_compiled_step_flattens_only_states_it_did_not_return(monkeypatch):
    """The state a compiled step returned comes back to it without being flattened again; any other
    state (a span moved, user criteria's ``done``) is flattened, and the tokens are eager's."""
    from genfn import compile_boundary
    from genfn.stopping.criteria import StoppingCriteriaList

    _, model = tiny_pair(eos_token_id=None, seed=4)
    ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(4))
    flattened = []  # the slow path's lookups of a layout's rebuild (the traced step reads neither)
    real = compile_boundary._join_code
    monkeypatch.setattr(compile_boundary, "_join_code", lambda layout: flattened.append(1) or real(layout))
    out = genfn.generate(model, ids, max_new_tokens=40, cache_implementation="static", max_cache_len=64)
    assert torch.equal(out, genfn.generate(model, ids, max_new_tokens=40))
    # 39 compiled steps from a span of 16 slots to 48: the first and the two where the span moved.
    flattened.clear()
    genfn.generate(model, ids, max_new_tokens=40, cache_implementation="static", max_cache_len=64)
    assert len(flattened) == 3
    # A criterion that returns a new ``done`` replaces the state between every step: each is flattened.
    never = StoppingCriteriaList([lambda input_ids, scores, **kw: torch.zeros(input_ids.shape[0], dtype=torch.bool)])
    flattened.clear()
    stopped = genfn.generate(model, ids, max_new_tokens=40, cache_implementation="static", max_cache_len=64,
                             stopping_criteria=never)
    assert len(flattened) == 39 and torch.equal(stopped, out)


def test_disable_compile_runs_eagerly():
    _, model = tiny_pair(eos_token_id=None)
    genfn.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, cache_implementation="static",
                   disable_compile=True)
    assert model.compiled_steps == {}


@pytest.mark.slow
def test_compiled_greedy_equals_eager_on_smollm2(smollm2, smollm2_prompts):
    """One SmolLM2 compile (minutes on 2 cores), so one mode here: greedy. Compiled sampling is
    checked token for token against eager on a tiny model in test_sampling.py; the sampling
    math (keyed noise, processors) does not depend on the model."""
    ids, mask = smollm2_prompts["input_ids"], smollm2_prompts["attention_mask"]
    common = dict(attention_mask=mask, max_new_tokens=24, max_cache_len=64)
    compiled = genfn.generate(smollm2, ids, cache_implementation="static", **common)
    assert torch.equal(compiled, genfn.generate(smollm2, ids, **common))


def test_compile_options_pick_max_autotune_and_the_cpp_wrapper_on_cpu_unless_told_otherwise():
    from genfn.compile_boundary import _CPU_COMPILE_OPTIONS, compile_options_for as _compile_options

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    static = dict(cache_implementation="static")
    assert _CPU_COMPILE_OPTIONS == {"max_autotune": True, "coordinate_descent_tuning": True, "cpp_wrapper": True,
                                    "cpp_wrapper_build_separate": True, "size_asserts": False}
    assert _compile_options(genfn.GenerationConfig(**static), cpu) == {"fullgraph": True,
                                                                       "options": _CPU_COMPILE_OPTIONS}
    # transformers' default mode is CUDA graphs ("reduce-overhead"): meaningless on a CPU, and
    # it would capture the donated buffers' addresses on a GPU.
    default_cc = genfn.GenerationConfig(compile_config=genfn.CompileConfig(), **static)
    assert _compile_options(default_cc, cpu)["options"] == _CPU_COMPILE_OPTIONS
    assert "mode" not in _compile_options(default_cc, cpu)
    assert "mode" not in _compile_options(default_cc, cuda) and "options" not in _compile_options(default_cc, cuda)
    loop_options = _compile_options(default_cc, cpu, whole_loop=True)["options"]
    assert "cpp_wrapper" not in loop_options and "cpp_wrapper_build_separate" not in loop_options
    chosen = genfn.GenerationConfig(compile_config=genfn.CompileConfig(mode="default"), **static)
    assert _compile_options(chosen, cpu)["mode"] == "default"
    with_options = genfn.GenerationConfig(compile_config=genfn.CompileConfig(mode=None, options={"freezing": True}),
                                          **static)
    assert "mode" not in _compile_options(with_options, cpu)
    assert _compile_options(genfn.GenerationConfig(disable_compile=True, **static), cpu) is None
    assert _compile_options(genfn.GenerationConfig(), cpu) is None  # dynamic cache: eager


def test_ten_calls_with_different_processor_values_compile_the_step_once():
    """Processor kinds key the compiled step; their numbers are tensor leaves, so new values never
    recompile (and compiled sampling equals eager for each of them)."""
    _, model = tiny_pair(eos_token_id=2)
    ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    before = _graphs()
    for i in range(10):
        settings = dict(do_sample=True, key=i, temperature=0.55 + 0.1 * i,  # never 1.0: that builds no processor top_p=0.5 + 0.05 * i, top_k=5 + 3 * i,
                        min_new_tokens=1 + i % 4, repetition_penalty=1.05 + 0.05 * i, max_new_tokens=10,
                        cache_implementation="static", max_cache_len=48)
        compiled = genfn.generate(model, ids, **settings)
        assert torch.equal(compiled, genfn.generate(model, ids, disable_compile=True, **settings)), f"call {i}"
    assert _graphs() - before == 1


def test_the_compiled_step_does_not_guard_on_its_own_weights():
    """The weights module is built for one compiled function and closed over by it alone, so
    dynamo's per-step guards leave it out (about 1,100 of SmolLM2's 1,450); a caller's own filter wins."""
    from types import SimpleNamespace

    from genfn import compile_boundary

    names = ["weights", "weights._buffers['p0']", "weights.q3.codes", "flat[0]", "value.spec.head_dim",
             "weights_of_something_else"]
    kept = compile_boundary._keep_guard([SimpleNamespace(name=n) for n in names])
    assert kept == [False, False, False, True, True, True]
    options = compile_boundary._without_weight_guards({"backend": "inductor", "options": {"max_autotune": True}})
    assert options["options"] == {"max_autotune": True, "guard_filter_fn": compile_boundary._keep_guard}

    def mine(entries):
        return [True] * len(entries)

    assert compile_boundary._without_weight_guards({"options": {"guard_filter_fn": mine}})["options"]["guard_filter_fn"] is mine


def test_the_filtered_step_still_recompiles_for_a_new_state_shape():
    """Guards on the state (the step's inputs) stay: a batch of another size gets its own graph
    and the right tokens."""
    _, model = tiny_pair(eos_token_id=None)
    for batch in (1, 3):
        ids = torch.randint(3, 97, (batch, 5), generator=torch.Generator().manual_seed(batch))
        out = genfn.generate(model, ids, max_new_tokens=6, cache_implementation="static", max_cache_len=32)
        assert torch.equal(out, genfn.generate(model, ids, max_new_tokens=6))
