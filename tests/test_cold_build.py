"""genfn.cold_build: inductor's ISA probe started early in a thread, and the C++ wrapper and kernels
compiled at once. Fake builders and probes stand in for g++; nothing here is timed."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import pytest
import torch

from genfn import cold_build, compile_backend

# Long enough for a loaded machine to start two threads, short enough that a serial build fails fast.
RENDEZVOUS_S = 20


class FakeBuilder:
    """A CppBuilder stand-in: ``build`` writes its target, after meeting ``rendezvous`` if given."""

    def __init__(self, path: Path, log: list, rendezvous: threading.Barrier | None = None):
        self.path, self.log, self.rendezvous = path, log, rendezvous

    def get_target_file_path(self) -> str:
        return str(self.path)

    def build(self) -> None:
        self.log.append(("start", self.path.name))
        if self.rendezvous is not None:
            self.rendezvous.wait()  # raises BrokenBarrierError if the other unit never starts alongside
        self.path.write_text("built")
        self.log.append(("end", self.path.name))


def _wrapper_kernels_linker(tmp_path, log, rendezvous=None):
    return (FakeBuilder(tmp_path / "main.o", log, rendezvous), FakeBuilder(tmp_path / "optimized.o", log, rendezvous),
            FakeBuilder(tmp_path / "main.so", log))


def test_the_wrapper_and_kernel_units_build_at_the_same_time_and_link_after_both(tmp_path):
    log = []
    builders = _wrapper_kernels_linker(tmp_path, log, threading.Barrier(2, timeout=RENDEZVOUS_S))
    cold_build.build_units_in_parallel(str(tmp_path / "lock"), builders)
    assert sorted(log[:2]) == [("start", "main.o"), ("start", "optimized.o")], "both units start before either ends"
    assert log[-2:] == [("start", "main.so"), ("end", "main.so")], "the link comes last"
    assert all(b.path.read_text() == "built" for b in builders)


def test_inductors_own_worker_builds_them_one_after_the_other(tmp_path):
    """What the test above guards against: inductor's serial worker never meets the rendezvous."""
    from torch._inductor import codecache

    builders = _wrapper_kernels_linker(tmp_path, [], threading.Barrier(2, timeout=0.5))
    with pytest.raises(threading.BrokenBarrierError):
        codecache._worker_compile_cpp(str(tmp_path / "lock"), builders)


def test_built_units_are_not_built_again_and_a_single_builder_is_built_alone(tmp_path):
    log = []
    wrapper, kernels, linker = _wrapper_kernels_linker(tmp_path, log)
    kernels.path.write_text("cached")
    cold_build.build_units_in_parallel(str(tmp_path / "lock"), (wrapper, kernels, linker))
    assert [entry for entry in log if entry[0] == "start"] == [("start", "main.o"), ("start", "main.so")]
    assert kernels.path.read_text() == "cached"
    one = FakeBuilder(tmp_path / "one.so", log)
    cold_build.build_units_in_parallel(str(tmp_path / "lock"), (one,))
    assert one.path.read_text() == "built"


def test_the_parallel_worker_is_inductors_only_inside_the_block_even_when_it_raises():
    from torch._inductor import codecache

    original = codecache._worker_compile_cpp
    with pytest.raises(RuntimeError):
        with cold_build.parallel_cpp_units():
            assert codecache._worker_compile_cpp is cold_build.build_units_in_parallel
            with cold_build.parallel_cpp_units():
                pass
            assert codecache._worker_compile_cpp is cold_build.build_units_in_parallel, "an inner block keeps it"
            raise RuntimeError("a compile failed")
    assert codecache._worker_compile_cpp is original


@pytest.fixture
def fake_probe(monkeypatch):
    """A cached probe like inductor's ``valid_vec_isa_list``; the list holds each call's thread."""
    calls = []

    @functools.cache
    def probe():
        calls.append(threading.current_thread().name)
        return ["avx2"]

    monkeypatch.setattr(cold_build, "inductor_vec_isa_probe", lambda: probe)
    monkeypatch.setattr(cold_build, "probe_store", lambda: Path("/nonexistent/genfn-probe-store"))
    return probe, calls


def test_the_isa_probe_runs_in_a_thread_for_a_cpu_graph(fake_probe):
    probe, calls = fake_probe
    thread = cold_build.start_vec_isa_probes([torch.zeros(2), 3], {"max_autotune": True})
    thread.join(timeout=RENDEZVOUS_S)
    assert not thread.is_alive() and calls == ["genfn-vec-isa-probe"]
    assert cold_build.start_vec_isa_probes([torch.zeros(2)], {}) is None, "a probed process does not probe again"


def test_no_early_probe_off_the_cpu_or_when_the_options_set_cpp_settings(fake_probe):
    probe, calls = fake_probe
    assert cold_build.start_vec_isa_probes([torch.zeros(2, device="meta")], {}) is None
    assert cold_build.start_vec_isa_probes([torch.zeros(2)], {"cpp.vec_isa_ok": True}) is None
    assert calls == []


def test_the_backend_compiles_with_the_parallel_worker_and_puts_inductors_back(monkeypatch):
    import torch._inductor.compile_fx
    from torch._inductor import codecache

    original = codecache._worker_compile_cpp
    workers = []

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        workers.append(codecache._worker_compile_cpp)
        return gm.forward

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", fake_compile_fx)
    torch._dynamo.reset()
    kwargs = compile_backend.with_genfn_backend({"fullgraph": True})
    x = torch.randn(4)
    assert torch.equal(torch.compile(lambda x: x * 2, **kwargs)(x), x * 2)
    assert workers == [cold_build.build_units_in_parallel]
    assert codecache._worker_compile_cpp is original


def test_the_stored_probe_libraries_are_what_a_probe_built_in_a_temporary_inductor_cache(monkeypatch, tmp_path):
    ran = []

    def fake_probe_process(command, env, **kwargs):
        cache = Path(env["TORCHINDUCTOR_CACHE_DIR"])
        ran.append((command[-1], cache))
        for name in ("ab/cab1.so", "cd/ccd2.so"):
            (cache / name).parent.mkdir(parents=True, exist_ok=True)
            (cache / name).write_text(name)
        (cache / "ab" / "cab1.cpp").write_text("source")

    monkeypatch.setattr(cold_build.subprocess, "run", fake_probe_process)
    stored = cold_build.store_vec_isa_probes(tmp_path / "store")
    assert stored == [Path("ab/cab1.so"), Path("cd/ccd2.so")]
    assert (tmp_path / "store" / "cd" / "ccd2.so").read_text() == "cd/ccd2.so"
    assert not (tmp_path / "store" / "ab" / "cab1.cpp").exists(), "only the libraries are kept"
    assert ran[0][0] == cold_build._PROBE_PROGRAM and not ran[0][1].exists(), "the temporary cache is removed"


def test_seeding_copies_only_what_the_inductor_cache_lacks(tmp_path):
    store, cache = tmp_path / "store", tmp_path / "cache"
    for name in ("ab/cab1.so", "cd/ccd2.so"):
        (store / name).parent.mkdir(parents=True, exist_ok=True)
        (store / name).write_text("stored")
    (cache / "ab").mkdir(parents=True)
    (cache / "ab" / "cab1.so").write_text("inductor's own")
    assert cold_build.seed_vec_isa_probes(store, cache) == 1
    assert (cache / "ab" / "cab1.so").read_text() == "inductor's own"
    assert (cache / "cd" / "ccd2.so").read_text() == "stored"
    assert not list(cache.rglob("*.partial"))
    assert cold_build.seed_vec_isa_probes(tmp_path / "no-store", cache) == 0


def test_the_cache_is_seeded_before_the_probe_runs(fake_probe, monkeypatch, tmp_path):
    probe, calls = fake_probe
    store, cache = tmp_path / "store", tmp_path / "cache"
    (store / "ab").mkdir(parents=True)
    (store / "ab" / "cab1.so").write_text("stored")
    monkeypatch.setattr(cold_build, "probe_store", lambda: store)
    monkeypatch.setattr(cold_build, "inductor_cache_dir", lambda: cache)
    thread = cold_build.start_vec_isa_probes([torch.zeros(2)], {})
    thread.join(timeout=RENDEZVOUS_S)
    assert calls and (cache / "ab" / "cab1.so").read_text() == "stored"
