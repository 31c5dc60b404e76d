"""Start-up machinery, without timing anything: the kernel build cache key, the per-graph freezing
decision of the compile backend, what ``import genfn`` imports, and the OpenMP wait policy genfn
sets at import."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from genfn import compile_backend, kernels, wait_policy
from genfn.kernels import native

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------
# kernel build cache


@pytest.fixture
def fake_compiler(monkeypatch, tmp_path):
    """``native.build`` against a temporary cache (and no installed builds), with g++ replaced by a
    recorder that writes the output file: the list holds the output path of every compile that ran."""
    builds = []

    def fake_run(command, **kwargs):
        output = Path(command[command.index("-o") + 1])
        output.write_bytes(b"not a real library")
        builds.append(output)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setenv("GENFN_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("GENFN_KERNEL_PREBUILT", str(tmp_path / "prebuilt"))
    monkeypatch.setattr(native.subprocess, "run", fake_run)
    monkeypatch.setattr(native.shutil, "which", lambda name: "/usr/bin/" + name)
    return builds


def test_a_second_build_with_the_same_sources_torch_and_flags_reuses_the_cached_library(fake_compiler):
    first = native.build(native.DECODE)
    second = native.build(native.DECODE)
    assert first == second and first.exists()
    assert len(fake_compiler) == 1, "the second build must find the cached library"
    assert first.parent == Path(os.environ["GENFN_KERNEL_CACHE"])


def test_the_build_key_changes_with_torch_version_and_sources(fake_compiler, monkeypatch, tmp_path):
    original = native.build(native.DECODE)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__version__", torch.__version__ + "+other")
        other_torch = native.build(native.DECODE)
    assert other_torch != original

    edited = []
    for source in native.DECODE.sources:
        copy = tmp_path / source.name
        copy.write_text(source.read_text() + "\n// edited\n")
        edited.append(copy)
    assert native.build(dataclasses.replace(native.DECODE, sources=tuple(edited))) not in (original, other_torch)
    assert len(fake_compiler) == 3


def test_the_first_build_is_announced_on_the_genfn_logger(fake_compiler, caplog):
    with caplog.at_level("INFO", logger="genfn"):
        native.build(native.DECODE)
        native.build(native.DECODE)
    messages = [r.getMessage() for r in caplog.records if r.name == "genfn.kernels"]
    assert len(messages) == 2, messages  # building ..., built in ... s; nothing for the cached one
    assert messages[0].startswith("building the native decode kernels into ")
    assert messages[1].startswith("built the native decode kernels in")


# ------------------------------------------------------------------------------------------
# freezing only where a graph holds a library linear


def _dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    return graphs[0]


def test_library_linears_counts_f_linear_and_not_the_native_kernels():
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    assert compile_backend.library_linears(_dynamo_graph(lambda x, w: F.linear(F.linear(x, w), w.T), x, w)) == 2
    assert compile_backend.library_linears(_dynamo_graph(lambda x, w: (x @ w.T).relu(), x, w)) == 0
    if kernels.decode_linear_available():
        assert compile_backend.library_linears(_dynamo_graph(kernels.linear, x, w)) == 0


@pytest.fixture
def recorded_patches(monkeypatch):
    """Replaces inductor's compile_fx with a recorder of the config patches it would compile under."""
    import torch._inductor.compile_fx

    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(dict(config_patches or {}))
        return gm.forward

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", fake_compile_fx)
    return seen


def _compile_with_backend(fn, options, *args):
    torch._dynamo.reset()
    kwargs = compile_backend.with_genfn_backend(options)
    with torch.no_grad():
        return torch.compile(fn, **kwargs)(*args)


def test_the_backend_freezes_only_graphs_that_hold_a_library_linear(recorded_patches):
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    _compile_with_backend(lambda x, w: F.linear(x, w), {"fullgraph": True, "options": {"max_autotune": True}}, x, w)
    _compile_with_backend(lambda x, w: (x * 2).sum() + w.sum(), {"fullgraph": True}, x, w)
    assert [p["freezing"] for p in recorded_patches] == [True, False]
    assert recorded_patches[0]["max_autotune"] is True, "the user's options reach inductor"


def test_an_explicit_freezing_option_wins(recorded_patches):
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    _compile_with_backend(lambda x, w: (x * 2).sum() + w.sum(), {"options": {"freezing": True}}, x, w)
    _compile_with_backend(lambda x, w: F.linear(x, w), {"options": {"freezing": False}}, x, w)
    assert [p["freezing"] for p in recorded_patches] == [True, False]


def test_the_backend_says_when_inductor_starts_and_how_its_compile_went(recorded_patches, caplog):
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    with caplog.at_level("INFO", logger="genfn"):
        _compile_with_backend(lambda x, w: (x * 2).sum() + w.sum(), {"fullgraph": True}, x, w)
    messages = [r.getMessage() for r in caplog.records if r.name == "genfn.compile_backend"]
    assert len(messages) == 2, messages
    assert messages[0].startswith("inductor: compiling the traced graph (") and "C++ build" in messages[0]
    # The recorder stands in for inductor and reads no cache, so the compile counts as a build.
    assert messages[1].startswith("inductor: generated and built the graph's C++ in "), messages[1]


def test_the_on_disk_caches_are_keyed_on_genfns_native_libraries(recorded_patches, monkeypatch):
    """Inductor's and AOT autograd's cache keys name an op, not its signature: a cached C++ wrapper
    once called an op that had gained an argument with the old argument list (free(): invalid
    pointer). A pass that changes nothing puts the libraries' build keys into both keys; a user's
    own pass is left alone."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from genfn.kernels import native

    x, w = torch.randn(1, 64), torch.randn(32, 64)
    _compile_with_backend(lambda x, w: (x * 2).sum() + w.sum(), {"fullgraph": True}, x, w)
    key_pass = recorded_patches[0]["post_grad_custom_post_pass"]
    assert isinstance(key_pass, CustomGraphPass)
    assert all(native.library_key(library) in key_pass.uuid() for library in native.LIBRARIES)
    graph = torch.fx.symbolic_trace(lambda x: x * 2).graph
    before = str(graph)
    assert key_pass(graph) is None and str(graph) == before

    first = key_pass.uuid()
    monkeypatch.setattr(native, "library_key", lambda library: "another-build")
    assert key_pass.uuid() != first and "another-build" in key_pass.uuid()  # another build, another key
    theirs = compile_backend.native_libraries_key()
    _compile_with_backend(lambda x, w: (x * 3).sum() + w.sum(), {"options": {"post_grad_custom_post_pass": theirs}},
                          x, w)
    with config.patch(post_grad_custom_post_pass=theirs):
        _compile_with_backend(lambda x, w: (x * 4).sum() + w.sum(), {}, x, w)
    assert recorded_patches[1]["post_grad_custom_post_pass"] is theirs
    assert "post_grad_custom_post_pass" not in recorded_patches[2]


def test_other_backends_and_modes_pass_through():
    assert compile_backend.with_genfn_backend({"backend": "eager", "fullgraph": True}) == {"backend": "eager",
                                                                                        "fullgraph": True}
    kwargs = compile_backend.with_genfn_backend({"mode": "max-autotune-no-cudagraphs", "fullgraph": True})
    assert "mode" not in kwargs and kwargs["fullgraph"] is True
    assert kwargs["backend"].config.get("max_autotune") is True, "the mode's options are kept"


# ------------------------------------------------------------------------------------------
# the params tree the compiled step reads its weights from


def _params_with_every_kind_of_node():
    from genfn.quant.weight import QuantizedWeight

    blocks = QuantizedWeight(torch.randn(4, 2), torch.randn(4), None, format="q4_1", out_features=4, in_features=8)
    layer = {"norm": torch.randn(8), "w": blocks, 7: torch.randn(2)}  # an int key: not a literal dict key
    return {"embed": torch.randn(3, 8), "layers": [layer, dict(layer, norm=torch.randn(8))],
            "pair": (torch.randn(1), None), "inv_freq": torch.randn(4)}


def test_the_params_module_rebuilds_its_tree_from_the_same_tensors():
    import torch.utils._pytree as torch_pytree

    from genfn.driver import ParamsModule

    params = _params_with_every_kind_of_node()
    rebuilt = ParamsModule(params).tree()
    leaves, spec = torch_pytree.tree_flatten(params)
    rebuilt_leaves, rebuilt_spec = torch_pytree.tree_flatten(rebuilt)
    assert rebuilt_spec == spec
    assert all(a is b for a, b in zip(rebuilt_leaves, leaves)), "the module's buffers are the params' own tensors"
    assert rebuilt["layers"][1]["w"].format == "q4_1" and rebuilt["layers"][1]["w"].in_features == 8


def test_the_params_tree_traces_under_dynamo_to_its_buffers():
    from genfn.driver import ParamsModule

    params = _params_with_every_kind_of_node()
    weights = ParamsModule(params)

    def read(x):
        tree = weights.tree()
        return x * tree["layers"][1]["norm"] + tree["layers"][0]["w"].scales.sum() + tree["pair"][0]

    x = torch.randn(8)
    torch._dynamo.reset()
    compiled = torch.compile(read, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), read(x))
    params["layers"][1]["norm"].mul_(2)  # the buffers are the params' tensors, read at call time
    assert torch.equal(compiled(x), read(x))


_COMPILE_A_QUANTIZED_STEP = """
import sys, torch, genfn
sys.path.insert(0, "tests")
from test_quantized import _tiny
from genfn.models.quantized import quantize_params
from torch._dynamo.utils import counters
model = _tiny(seed=1)
model.params = quantize_params(model.params, "q4_1")
genfn.generate(model, torch.tensor([[5, 17, 3, 88]]), cache_implementation="static", max_cache_len=32,
               max_new_tokens=3, do_sample=False, pad_token_id=0)
print(dict(counters["aot_autograd"]))
"""


@pytest.mark.slow
def test_a_second_process_loads_the_quantized_step_from_aot_autograds_cache(tmp_path):
    # The params tree once reached quantized weights through an exec'd function's globals, which
    # dynamo names by the dict's id: every process traced a differently named graph and missed.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    counts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _COMPILE_A_QUANTIZED_STEP], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        counts.append(done.stdout.strip().splitlines()[-1])
    assert "autograd_cache_miss" in counts[0] and "autograd_cache_hit" not in counts[0], counts
    assert "autograd_cache_hit" in counts[1] and "autograd_cache_miss" not in counts[1], counts


# ------------------------------------------------------------------------------------------
# what import genfn costs


def test_importing_genfn_and_its_command_line_leaves_dynamo_inductor_and_transformers_unimported():
    # Dynamo's import alone was ~1-3 s of every eager run's start (an import-time decorator).
    script = ("import sys, genfn, genfn.cli; print(sorted(name for name in ('torch._dynamo', 'torch._inductor', "
              "'transformers') if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


_EAGER_ON_A_STATIC_CACHE = """
import sys, torch, genfn
from genfn.default_model import default_model_path
model = genfn.load(default_model_path(), quantize="gguf")
ids = torch.tensor([[1, 2, 3, 4, 1, 2, 3]])
for extra in ({}, {"do_sample": True, "top_k": 5}, {"num_beams": 2}, {"prompt_lookup_num_tokens": 3}):
    genfn.generate(model, ids, cache_implementation="static", disable_compile=True, max_new_tokens=20, **extra)
print("torch._dynamo" in sys.modules)
"""


def test_an_eager_run_on_a_static_cache_leaves_dynamo_unimported():
    # Marking the attended span dynamic (for a compiled step) imported dynamo at an eager run's
    # first span: ~0.9 s of its first token, for a mark nothing reads.
    done = subprocess.run([sys.executable, "-c", _EAGER_ON_A_STATIC_CACHE], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_constant_result_leaves_the_mark_torchs_own_decorator_leaves():
    from genfn.kernels import invariant
    from genfn.torch_compat import CONSTANT_RESULT_MARK, constant_result

    def by_torch():
        return 1

    def by_genfn():
        return 1

    torch.compiler.assume_constant_result(by_torch)
    constant_result(by_genfn)
    assert getattr(by_torch, CONSTANT_RESULT_MARK) is True and getattr(by_genfn, CONSTANT_RESULT_MARK) is True
    assert getattr(invariant.batch_invariant, CONSTANT_RESULT_MARK) is True


_TRACE_THE_MODE_IN_A_FRESH_PROCESS = """
import sys, torch, genfn
from genfn.kernels.invariant import batch_invariant, deterministic
assert "torch._dynamo" not in sys.modules
def step(x):
    return x + 1 if batch_invariant() else x - 1
print(torch.compile(step, fullgraph=True, backend="eager")(torch.zeros(1)).item())
"""


def test_the_mode_marked_before_dynamo_loads_still_traces_as_a_constant():
    # A ContextVar read that dynamo was not told is constant fails a fullgraph trace (Unsupported).
    done = subprocess.run([sys.executable, "-c", _TRACE_THE_MODE_IN_A_FRESH_PROCESS], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "-1.0"


# ------------------------------------------------------------------------------------------
# OpenMP wait policy


CLI = ["python", "-m", "genfn", "serve"]


def test_the_policy_follows_the_load_in_genfns_command_line_only_when_nothing_is_chosen_and_torch_is_not_loaded():
    quiet, busy = {}, {}
    assert "genfn's choice" in wait_policy.apply_default(quiet, torch_loaded=False, load=0.1, argv=CLI)
    assert wait_policy.apply_default(busy, torch_loaded=False, load=wait_policy.BUSY_LOAD, argv=CLI).startswith("OMP_WAIT_POLICY")
    assert quiet == wait_policy.QUIET_POLICY and busy == wait_policy.BUSY_POLICY and quiet != busy
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}, {"GENFN_WAIT_POLICY": "default"}):
        env = dict(chosen)
        assert "left to the environment" in wait_policy.apply_default(env, torch_loaded=False, load=0.0, argv=CLI)
        assert env == chosen
    env = {}
    assert "torch was imported before genfn" in wait_policy.apply_default(env, torch_loaded=True, load=0.0, argv=CLI)
    assert env == {}


def test_a_library_import_leaves_the_environment_alone_unless_the_user_opts_in():
    for argv in (["python", "-c", "import genfn"], ["python", "train.py"], ["python", "-m", "pytest"], ["ipython"]):
        env = {}
        assert "imported as a library" in wait_policy.apply_default(env, torch_loaded=False, load=0.0, argv=argv)
        assert env == {}
    env = {"GENFN_WAIT_POLICY": wait_policy.AUTO}
    assert "genfn's choice" in wait_policy.apply_default(env, torch_loaded=False, load=0.0, argv=["python", "train.py"])
    assert env == {"GENFN_WAIT_POLICY": "auto", **wait_policy.QUIET_POLICY}


def test_launched_as_cli_knows_genfns_own_command_lines():
    for argv in (["python", "-m", "genfn", "generate"], ["python", "-u", "-m", "genfn"], ["/usr/bin/python3", "/usr/local/bin/genfn", "serve"],
                 ["python", "-X", "importtime", "-m", "genfn.cli", "chat"]):
        assert wait_policy.launched_as_cli(argv), argv
    for argv in (["python", "-m", "genfn.bench"], ["python", "bench.py", "-m", "genfn"], ["python", "-c", "x"], ["python"],
                 ["python", "/home/me/genfn_train.py"]):
        assert not wait_policy.launched_as_cli(argv), argv


def test_other_load_counts_a_busy_process_and_not_this_one():
    assert 0.0 <= wait_policy.other_load(0.05) <= os.cpu_count()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        samples = [wait_policy.other_load(0.2) for _ in range(3)]
    finally:
        busy.kill()
        busy.wait(timeout=30)
    assert max(samples) >= 0.3, samples  # the busy loop gets at least a share of a core
    own = [wait_policy.other_load(0.0) for _ in range(3)]
    assert all(load >= 0.0 for load in own)


def test_a_fresh_library_import_sets_nothing_and_the_opt_in_chooses():
    script = ("import os, genfn; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), '|', "
              "genfn.wait_policy.wait_policy())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "GENFN_WAIT_POLICY")}
    outcomes = []
    for extra in ({}, {"GENFN_WAIT_POLICY": wait_policy.AUTO}):
        fresh = subprocess.run([sys.executable, "-c", script], env={**env, **extra, "PYTHONPATH": str(ROOT)},
                               capture_output=True, text=True, timeout=300)
        assert fresh.returncode == 0, fresh.stderr
        outcomes.append(tuple(part.strip() for part in fresh.stdout.split("|")))
    (plain_settings, plain_policy), (auto_settings, auto_policy) = outcomes
    assert plain_settings == "None None" and "imported as a library" in plain_policy
    assert "genfn's choice" in auto_policy
    assert auto_settings in ("PASSIVE None", f"None {wait_policy.QUIET_POLICY['GOMP_SPINCOUNT']}"), auto_settings
