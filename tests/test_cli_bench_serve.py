"""`genfn bench` (runs the decode benchmark, plots tokens/s beside its JSON) and `genfn serve`
(genfn.serve's options, imported only for that command, with a clear error without the extra)."""

from __future__ import annotations

import json
import struct
import sys

import pytest

from genfn import cli
from genfn.cli import bench


def _results(path, measured: dict):
    rows = [{"engine": engine, "format": fmt, "batch": batch, "tok_s": tok_s, "error": None}
            for (engine, fmt, batch), tok_s in measured.items()]
    rows.append({"engine": "llama.cpp", "format": "q4_1", "batch": 1, "tok_s": None, "error": "not installed"})
    path.write_text(json.dumps({"args": {"new_tokens": 32}, "threads": 2, "results": rows}))
    return path


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return struct.unpack(">II", data[16:24])


def test_plot_draws_every_measured_configuration(tmp_path):
    import matplotlib.image

    source = _results(tmp_path / "decode.json", {("genfn", "float32", 1): 40.0, ("genfn-compiled", "float32", 1): 52.5,
                                                 ("genfn", "q4_1", 8): 300.0})
    png = bench.plot_results(str(source))
    assert png == str(tmp_path / "decode.png")
    width, height = _png_size(tmp_path / "decode.png")
    assert width > 300 and height > 200
    pixels = matplotlib.image.imread(png)
    assert pixels.std() > 0.05  # something is drawn, not a blank canvas


def test_bench_runs_the_script_and_plots_beside_its_json(tmp_path, capsys):
    # A stand-in for benchmarks/decode.py: records its arguments and writes results where told.
    script = tmp_path / "fake_decode.py"
    script.write_text(
        "import json, sys\n"
        "out = sys.argv[sys.argv.index('--json') + 1]\n"
        "rows = [{'engine': 'genfn', 'format': 'float32', 'batch': 1, 'tok_s': 10.0, 'error': None}]\n"
        "json.dump({'args': {'argv': sys.argv[1:]}, 'results': rows}, open(out, 'w'))\n")
    out = tmp_path / "run.json"
    assert cli.main(["bench", "--script", str(script), "--json", str(out), "--quick", "--",
                     "--dtypes", "q4_1"]) == 0
    argv = json.loads(out.read_text())["args"]["argv"]
    assert "--quick" in argv and argv[argv.index("--dtypes") + 1] == "q4_1"
    assert _png_size(tmp_path / "run.png")[0] > 0
    assert f"plot in {tmp_path / 'run.png'}" in capsys.readouterr().err


def test_bench_errors_are_one_line(tmp_path, capsys, monkeypatch):
    failing = _results(tmp_path / "failed.json", {})
    assert cli.main(["bench", "--plot", str(failing)]) == 2
    assert "no successful measurement" in capsys.readouterr().err
    assert cli.main(["bench", "--plot", str(tmp_path / "none.json")]) == 2
    assert "not found" in capsys.readouterr().err
    assert cli.main(["bench", "--script", str(tmp_path / "none.py")]) == 2
    assert "benchmark script not found" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert cli.main(["bench", "--plot", str(failing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib" in err and "genfn[bench]" in err


def test_serve_help_shows_the_servers_options(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--model"):
        assert flag in out, flag


def test_serve_without_the_extra_names_it(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as if starlette were not installed
                        lambda name, *a: None if name == "starlette" else real(name, *a))
    assert cli.main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("genfn: error: genfn serve needs the 'serve' extra")
    assert "starlette" in err and "pip install 'genfn[serve]'" in err
    # Every other command still works without it.
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
