"""Where the native kernel libraries come from (genfn/kernels/native.py): an installed build whose key
matches, else the cache, else a build; `genfn kernels status|build`; the install-time build
(setup.py); and the command line's one status line, "building" only when a build will run. No test
here runs the real compiler: g++ is replaced by a recorder that writes the output file."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from genfn import cli, cold_build, kernels
from genfn.cli.common import _prepare_kernels
from genfn.cli.status import Status
from genfn.kernels import kquant, native

ROOT = Path(__file__).resolve().parents[1]
AVX512 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"})


@pytest.fixture
def dirs(monkeypatch, tmp_path):
    """Empty installed-build and cache directories, an AVX-512 CPU, and a recording fake compiler:
    ``dirs.builds`` lists every output the compiler wrote."""
    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    prebuilt.mkdir()
    monkeypatch.setenv("GENFN_KERNEL_PREBUILT", str(prebuilt))
    monkeypatch.setenv("GENFN_KERNEL_CACHE", str(cache))
    monkeypatch.delenv("GENFN_KERNELS", raising=False)
    monkeypatch.setattr(native, "cpu_flags", lambda: AVX512)
    builds = []

    def fake_run(command, **kwargs):
        output = Path(command[command.index("-o") + 1])
        output.write_bytes(b"not a real library")
        builds.append(output)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(native.subprocess, "run", fake_run)
    monkeypatch.setattr(native.shutil, "which", lambda name: "/usr/bin/" + name)
    probe_stores = []  # each `genfn kernels build` also keeps inductor's ISA probes (genfn.cold_build)
    monkeypatch.setattr(cold_build, "store_vec_isa_probes", lambda: probe_stores.append(cold_build.probe_store()) or [])

    class Dirs:
        pass

    found = Dirs()
    found.prebuilt, found.cache, found.builds, found.probe_stores = prebuilt, cache, builds, probe_stores
    return found


def _place(directory: Path, name: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(b"a library")
    return directory / name


# ---- the loader's choice -------------------------------------------------------------------

def test_an_installed_build_whose_key_matches_is_loaded_without_compiling(dirs, monkeypatch):
    installed = _place(dirs.prebuilt, native.file_name(native.DECODE))
    _place(dirs.cache, native.file_name(native.DECODE))  # the installed one comes first
    assert native.plan(native.DECODE) == native.Plan("prebuilt", installed)
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    assert native.load(native.DECODE) == (True, f"loaded from {installed}")
    assert loaded == [str(installed)] and dirs.builds == []


def test_an_installed_build_for_other_sources_or_torch_is_never_picked(dirs, monkeypatch):
    _place(dirs.prebuilt, "decode_linear-0123456789abcdef.so")  # another key: other sources or flags
    assert native.plan(native.DECODE).action == "build"
    installed = _place(dirs.prebuilt, native.file_name(native.DECODE))
    assert native.plan(native.DECODE).path == installed
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert native.plan(native.DECODE) == native.Plan("build", dirs.cache / native.file_name(native.DECODE))
    monkeypatch.setattr(torch.ops, "load_library", lambda path: None)
    assert native.load(native.DECODE) == (True, f"loaded from {dirs.cache / native.file_name(native.DECODE)}")
    assert len(dirs.builds) == 1


def test_a_build_for_avx512_is_not_loaded_on_a_cpu_without_it(dirs, monkeypatch):
    _place(dirs.prebuilt, native.file_name(native.DECODE))
    _place(dirs.prebuilt, native.file_name(native.KQUANT))
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    found = native.plan(native.DECODE)
    assert found.action == "unavailable" and "lacks avx512f, avx512bw, avx512vl" in found.reason
    assert native.load(native.DECODE) == (False, found.reason)
    assert native.plan(native.KQUANT).action == "prebuilt"  # its AVX-512 path is chosen at run time


def test_the_key_names_the_isa_flags(dirs):
    other = dataclasses.replace(native.DECODE, isa_flags=("-march=native",))
    assert native.library_key(other) != native.library_key(native.DECODE)


def test_without_a_library_or_a_compiler_the_plan_says_so(dirs, monkeypatch):
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    found = native.plan(native.DECODE)
    assert found.action == "no compiler" and "no C++ compiler" in found.reason
    _place(dirs.cache, native.file_name(native.DECODE))
    assert native.plan(native.DECODE).action == "cached"  # a cached build needs no compiler
    monkeypatch.setenv("CXX", "/no/such/compiler")  # nor the compiler that built it
    assert native.plan(native.DECODE).action == "cached"


# ---- genfn kernels status | build ----------------------------------------------------------

def test_genfn_kernels_status_says_where_each_library_is(dirs, capsys):
    installed = _place(dirs.prebuilt, native.file_name(native.DECODE))
    assert cli.main(["kernels", "status"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"torch: {torch.__version__}" in out
    assert f"cache: {dirs.cache}" in out and f"installed builds: {dirs.prebuilt}" in out
    assert f"decode kernels: installed with genfn: {installed}" in out
    assert (f"K-quant kernels: not built yet: the first use (or `genfn kernels build`) compiles it into "
            f"{dirs.cache}") in out
    assert dirs.builds == []  # status never builds


def test_genfn_kernels_build_compiles_only_what_is_missing(dirs, capsys):
    cached = _place(dirs.cache, native.file_name(native.DECODE))
    assert cli.main(["kernels", "build"]) == 0
    captured = capsys.readouterr()
    assert sorted(path.name.split("-")[0] for path in dirs.builds) == ["decode_avx2", "kquant_linear"]
    assert f"decode kernels: cached: {cached}" in captured.out.splitlines()
    assert f"K-quant kernels: built: {dirs.cache / native.file_name(native.KQUANT)}" in captured.out.splitlines()
    assert "genfn: building the native K-quant kernels into" in captured.err
    assert cli.main(["kernels", "build"]) == 0  # a second run finds both
    assert f"K-quant kernels: cached: {dirs.cache / native.file_name(native.KQUANT)}" in capsys.readouterr().out
    assert len(dirs.builds) == 2
    assert dirs.probe_stores == [dirs.cache / "inductor-isa-probes"] * 2


def test_genfn_kernels_build_without_a_compiler_fails(dirs, monkeypatch, capsys):
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    assert cli.main(["kernels", "build"]) == 1
    assert "decode kernels: unavailable: not built, and no C++ compiler" in capsys.readouterr().out


def test_python_m_genfn_kernels_is_the_same_command(tmp_path):
    env = {"GENFN_KERNEL_CACHE": str(tmp_path / "cache"), "GENFN_KERNEL_PREBUILT": str(tmp_path / "prebuilt"),
           "GENFN_KERNELS": "0", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "genfn.kernels", "status"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "decode kernels: unavailable: disabled by GENFN_KERNELS=0" in done.stdout.splitlines()


# ---- install time (setup.py) ---------------------------------------------------------------

def _setup_module():
    spec = importlib.util.spec_from_file_location("genfn_setup_under_test", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines build_kernels without running setup()
    module._native = lambda: native  # the module the fixtures patched, not a second copy from the file
    return module


def test_the_install_time_build_puts_the_keyed_libraries_in_the_package(dirs, tmp_path, capsys):
    target = tmp_path / "package" / "genfn" / "kernels" / "prebuilt"
    stale = _place(target, "decode_linear-0123456789abcdef.so")
    written = _setup_module().build_kernels(target)
    assert sorted(path.name for path in written) == sorted(native.file_name(lib) for lib in native.LIBRARIES)
    assert all(path.parent == target and path.exists() for path in written) and not stale.exists()
    assert len(dirs.builds) == 3  # through the cache: the next install copies without compiling
    assert capsys.readouterr().err.count("genfn: building the native decode kernels into") == 1
    _setup_module().build_kernels(target)
    assert len(dirs.builds) == 3
    assert "building" not in capsys.readouterr().err


def test_the_install_time_build_skips_without_a_compiler(dirs, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    assert _setup_module().build_kernels(tmp_path / "prebuilt") == []
    assert "not building the native kernels at install time: no C++ compiler" in capsys.readouterr().err


# ---- the command line's status line --------------------------------------------------------

@pytest.fixture
def fresh_loader(monkeypatch):
    """genfn.kernels as in a new process, whose loading succeeds without touching torch.ops."""
    monkeypatch.setattr(kernels, "_available", None)
    monkeypatch.setattr(kernels, "_quant_native", None)
    monkeypatch.setattr(kernels, "_load", lambda: True)
    monkeypatch.setattr(kquant, "_native", None)
    monkeypatch.setattr(kquant, "_load", lambda: True)
    monkeypatch.setattr(kquant, "_register_fake", lambda native_ops: None)
    monkeypatch.setattr(kquant, "tiles_kernel_runs", lambda: False)  # asks the K-quant library's ops


def _status_lines(monkeypatch, kquant_too: bool = False) -> list[str]:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    _prepare_kernels(Status(live=False), kquant=kquant_too)
    return err.getvalue().splitlines()


def test_a_warm_start_says_loading_and_never_building(dirs, fresh_loader, monkeypatch):
    _place(dirs.cache, native.file_name(native.DECODE))
    lines = _status_lines(monkeypatch)
    assert lines[0] == "genfn: loading the native decode kernels..."
    assert lines[1].startswith("genfn: native decode kernels ready (")
    assert not any("build" in line for line in lines)


def test_a_cold_start_says_building_once_and_where(dirs, fresh_loader, monkeypatch):
    _place(dirs.cache, native.file_name(native.DECODE))
    lines = _status_lines(monkeypatch, kquant_too=True)  # a GGUF model kept quantized: the K-quant kernels too
    assert lines[0] == (f"genfn: building the native K-quant kernels into {dirs.cache} (once; a few minutes "
                        "of g++ on a 2-core machine)...")
    assert lines[1].startswith("genfn: built the native K-quant kernels (")


def test_without_a_compiler_the_line_does_not_promise_a_build(dirs, fresh_loader, monkeypatch):
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    assert _status_lines(monkeypatch)[0] == "genfn: loading the native decode kernels..."


def test_a_cpu_without_avx512_says_it_builds_the_stacks_avx2_library(dirs, fresh_loader, monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    lines = _status_lines(monkeypatch)
    assert lines[0] == (f"genfn: building the native decode kernels for AVX2 into {dirs.cache} (once; a few "
                        "minutes of g++ on a 2-core machine)...")
    assert lines[1].startswith("genfn: built the native decode kernels for AVX2 (")
