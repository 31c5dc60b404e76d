"""Every benchmark runs: each script in benchmarks/ answers --help from the package it imports
(no sys.path edits), and the packaged decode benchmark (python -m genfn.bench, the one genfn bench
runs) measures a tiny random model end to end, eager engines only (a compiled run takes minutes).
The full runs are the scripts' own business: they take minutes to hours on SmolLM2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cli_support import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (REPO / "benchmarks").glob("*.py"))
RUN_TIMEOUT_S = 300


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_do_not_edit_sys_path(script):
    assert "sys.path" not in script.read_text(encoding="utf-8"), f"{script.name} edits sys.path"


def test_every_script_answers_help(tmp_path):
    # One interpreter runs each script as `python benchmarks/NAME.py --help` would (its folder first
    # on sys.path, __name__ == "__main__"), so torch is imported once for all of them. It runs outside
    # the checkout with nothing of it on the path but benchmarks/, so a script importing the tests
    # (or anything genfn does not install) fails here as it would for a user.
    runner = textwrap.dedent("""\
        import contextlib, io, runpy, sys
        failures = []
        sys.path.insert(0, sys.argv[1])
        for script in sys.argv[2:]:
            sys.argv = [script, "--help"]
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as exit:
                code = exit.code or 0
            except Exception as err:
                code = f"{type(err).__name__}: {err}"
            if code != 0 or not out.getvalue().strip():
                failures.append(f"{script}: exit {code!r}, printed {len(out.getvalue())} characters")
        print("\\n".join(failures))
        """)
    done = subprocess.run([sys.executable, "-c", runner, str(REPO / "benchmarks"), *map(str, SCRIPTS)],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", done.stdout


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("bench_model"))


@pytest.mark.slow
def test_genfn_bench_measures_a_tiny_model_and_plots_it(tiny_model_dir, tmp_path):
    out = tmp_path / "decode.json"
    done = subprocess.run([sys.executable, "-m", "genfn", "bench", "--quick", "--json", str(out), "--",
                           "--model", str(tiny_model_dir), "--engines", "genfn,hf", "--new-tokens", "4",
                           "--no-second-process", "--no-latency"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "tokens genfn vs hf: equal" in done.stdout  # float32 greedy: transformers' tokens
    results = json.loads(out.read_text())["results"]
    assert {(r["engine"], r["format"], r["batch"]) for r in results} == {("genfn", "float32", 1), ("hf", "float32", 1)}
    assert all(r["error"] is None and r["tok_s"] > 0 for r in results)
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_quantized_formats_need_a_gguf_file(tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "genfn.bench", "--model", str(tiny_model_dir), "--dtypes", "q4_1"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env(), cwd=REPO)
    assert done.returncode == 2
    assert "--dtypes q4_1 read a GGUF file's blocks" in done.stderr


def test_results_go_to_the_checkout_or_the_working_directory(tmp_path, monkeypatch):
    from genfn.bench import results

    monkeypatch.delenv("GENFN_BENCH_RESULTS", raising=False)
    assert results.results_dir() == REPO / "benchmarks" / "results"  # this checkout
    monkeypatch.setenv("GENFN_BENCH_RESULTS", str(tmp_path / "mine"))
    written = results.write_results("decode", {"results": []}, tag="t")
    assert written.parent == tmp_path / "mine" and written.name.endswith("-t.json")
    assert json.loads(written.read_text()) == {"results": []}
    again = results.write_results("decode", {"results": [1]}, tag="t")  # the same minute, most likely
    assert again != written and again.name.endswith("-t.json")
    assert json.loads(written.read_text()) == {"results": []} and json.loads(again.read_text()) == {"results": [1]}


def test_importing_genfn_does_not_import_the_peers():
    code = "import sys, genfn, genfn.bench; print(sorted(m for m in ('transformers', 'llama_cpp', 'matplotlib') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env=_env(), cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_genfn_bench_runs_under_openmps_default_unless_the_user_chose(monkeypatch):
    from genfn import wait_policy
    from genfn.cli.bench import benchmark_environment

    monkeypatch.delenv("GENFN_WAIT_POLICY", raising=False)
    monkeypatch.setattr(wait_policy, "_outcome", "OMP_WAIT_POLICY=PASSIVE (genfn's choice: other load 1.00 cores >= 0.5)")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # what import genfn set in this process
    env = benchmark_environment()
    assert "OMP_WAIT_POLICY" not in env and env["GENFN_WAIT_POLICY"] == "default"
    monkeypatch.setattr(wait_policy, "_outcome", "left to the environment (OMP_WAIT_POLICY=PASSIVE)")
    assert benchmark_environment()["OMP_WAIT_POLICY"] == "PASSIVE"  # the user's own choice is kept


def test_model_bench_times_the_load_alone_and_reads_its_own_peak(tiny_model_dir, tmp_path):
    """The load bar (<= 1 s/GB, peak <= 1.15x the file) is the load's own: the imports and the
    native kernels come before the timer, and the peak is VmHWM reset just before the load, so it
    is at least what the load left resident and at most the run's peak. Where there is no
    /proc/self/status (not Linux) the load's peak is reported as not read (NaN), never guessed."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "model_bench.py"), "--child", "--model",
                           str(tiny_model_dir), "--engine", "genfn", "--batches", "1", "--new-tokens", "2",
                           "--prefill", "0", "--repeats", "1", "--threads", "1"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert result["import_s"] > 0 and result["load_s"] > 0
    assert result["decode_tok_s"]["1"] > 0
    if Path("/proc/self/status").exists():
        assert result["rss_after_load_mb"] <= result["load_peak_mb"] <= result["peak_rss_mb"]
    else:
        assert math.isnan(result["load_peak_mb"])


def test_model_bench_pairs_each_round_with_its_peers():
    """On a VM whose read bandwidth drifts, the ratio that counts is genfn's over each peer's in the
    same round; a failed run drops only its own round."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("model_bench_under_test", REPO / "benchmarks" / "model_bench.py")
    model_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model_bench)
    runs = {"genfn": [{"decode_tok_s": {"1": 1.0}}] * 2,
            "genfn-compiled": [{"decode_tok_s": {"1": 40.0, "8": 90.0}}, {"decode_tok_s": {"1": 44.0}}],
            "llama.cpp": [{"error": "crashed"}, {"decode_tok_s": {"1": 30.0}}],
            "llama-bench": [{"decode_tok_s": {1: 50.0}}, {"decode_tok_s": {1: 40.0}}]}
    assert model_bench.paired_ratios(runs) == {"genfn-compiled / llama.cpp b1": [44.0 / 30.0],
                                               "genfn-compiled / llama-bench b1": [0.8, 1.1]}
    # a coded run is put over the plain compiled one as well as over the peers
    runs["genfn-coded"] = [{"decode_tok_s": {"1": 50.0}}, {"decode_tok_s": {"1": 55.0}}]
    ratios = model_bench.paired_ratios(runs)
    assert ratios["genfn-coded / genfn-compiled b1"] == [50.0 / 40.0, 55.0 / 44.0]
    assert ratios["genfn-coded / llama-bench b1"] == [1.0, 55.0 / 40.0]
    assert "genfn / llama.cpp b1" not in ratios
    # the AVX2 engines: the compiled one (else the eager one) over genfn's own eager run and the peers
    runs["genfn-avx2"] = [{"decode_tok_s": {"1": 10.0}}] * 2
    runs["genfn-avx2-compiled"] = [{"decode_tok_s": {"1": 20.0}}, {"decode_tok_s": {"1": 30.0}}]
    ratios = model_bench.paired_ratios(runs)
    assert ratios["genfn-avx2-compiled / genfn b1"] == [20.0, 30.0]
    assert ratios["genfn-avx2-compiled / llama-bench b1"] == [0.4, 0.75]
    assert not any(key.startswith("genfn-avx2 /") for key in ratios)
    del runs["genfn-avx2-compiled"]
    assert model_bench.paired_ratios(runs)["genfn-avx2 / llama-bench b1"] == [0.2, 0.25]


def test_model_bench_names_the_engines_it_knows():
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("model_bench_engines", REPO / "benchmarks" / "model_bench.py")
    model_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model_bench)
    args = argparse.Namespace(model="x.gguf", model_engines="genfn,genfn-fast", batches="1")
    with pytest.raises(ValueError, match="genfn-fast unknown; choose among genfn, genfn-coded"):
        model_bench.from_decode_args(args)


def test_code_entropy_counts_each_field_and_bounds_a_recoding():
    """``code_entropy.py``'s order-0 bound: an even histogram costs its log2, a constant nothing, and
    a format's fields cost no more than they store (Q4_0's codes at most 4 bits; Q8_0's float16
    scales at most 16)."""
    import importlib.util

    import numpy as np
    import torch

    from genfn.bench.gguf_matrices import encode

    spec = importlib.util.spec_from_file_location("code_entropy_under_test", REPO / "benchmarks" / "code_entropy.py")
    code_entropy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code_entropy)
    assert code_entropy.entropy_bits(np.arange(16)) == pytest.approx(64.0)
    assert code_entropy.entropy_bits(np.full(100, 7)) == 0.0
    values = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    for ggml_type, code_bits in (("Q4_0", 4), ("Q8_0", 8), ("Q6_K", 6)):
        raw, _ = encode(values, ggml_type)
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(64, -1)
        fields = code_entropy.field_entropies(raw, ggml_type, (64, 256))
        assert 0 < fields["codes"] <= code_bits * values.numel()
        assert 0 < fields["d"] <= 16 * values.numel() / (32 if ggml_type != "Q6_K" else 256)
        tally = code_entropy.Tally()
        tally.add(ggml_type, raw, (64, 256), coded=False)
        (row,) = tally.rows()
        assert row["stored_over_entropy"] > 1.0 and row["stored_bits_per_weight"] == {"Q4_0": 4.5, "Q8_0": 8.5, "Q6_K": 6.5625}[ggml_type]
    with pytest.raises(ValueError, match="Q2_K is not measured"):
        code_entropy.field_entropies(raw, "Q2_K", (64, 256))


def test_lookup_rounds_counts_the_rounds_without_drafts_and_times_both_strategies():
    """``lookup_rounds.py --compare-wide --prompt open``, eagerly on SmolLM2's Q4_1 blocks: the
    default strategy runs some rounds one position wide, the wide one none, and both give greedy's
    tokens (the script checks the default's; the pairs' ratio is a number)."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "lookup_rounds.py"), "--quantize", "gguf",
                           "--lookup-tokens", "3", "--repeats", "1", "--prompt", "open", "--compare-wide",
                           "--passes", "1"], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env(),
                          cwd=REPO / "benchmarks")
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [json.loads(text) for text in done.stdout.splitlines() if text.startswith("{")]
    assert line["k"] == 3 and line["prompt"] == "open" and line["identical_to_greedy"] is True
    assert line["narrow_rounds"] > 0 and line["pass_index"] == 0
    assert line["paired_narrow_round_ms"] > 0 and line["paired_wide_round_ms"] > 0
    assert math.isfinite(line["narrow_over_wide_median"])


def test_prefill_kernels_times_each_format_and_the_attention():
    """``prefill_kernels.py`` at a tiny shape: a line per format with a finite checksum, and the
    attention's lines where a decode library loads."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "prefill_kernels.py"), "--formats",
                           "q8_0,q4_k,bf16", "--shapes", "32x256", "--rows", "20", "--heads", "2/1",
                           "--repeats", "1", "--threads", "1"], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=_env(), cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    for fmt in ("q8_0", "q4_k", "bf16"):
        (line,) = [text for text in lines if text.split()[:2] == ["32x256", fmt]]
        assert math.isfinite(float(line.rsplit("checksum ", 1)[1]))
    attention = [text for text in lines if text.startswith("attention 2/1 heads")]
    assert len(attention) == 2 or any(text.startswith("# no prefill attention op") for text in lines)
