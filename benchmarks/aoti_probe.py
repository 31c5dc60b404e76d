"""Probe: genfn's compiled decode step as an AOTInductor package, and what a second process pays to use it.

    python benchmarks/aoti_probe.py save --format float32 --package /tmp/step.pt2   # export + AOTInductor build
    python benchmarks/aoti_probe.py load --format float32 --package /tmp/step.pt2   # a fresh process: load + step

Not part of the library: an experiment for issue 31 (a warm second process's first compiled token
in <= 3 s). ``torch.compile``'s warm path re-runs dynamo's trace and reloads inductor's cached graph
in every process (6.5-8.5 s of the 11.6-12.9 s in ``startup-2026-12-02-session6.log``); an
AOTInductor package skips both: the process loads a shared library and calls it.

Both modes load the embedded SmolLM2 and run ``genfn.generate`` on the static cache with the
driver's compile replaced by the plain step function (``_cached_compile`` patched), which hands the
probe the step's flat tensor inputs and the function over them. ``save`` exports that function
(``torch.export``, non-strict; the attention span's dim dynamic as the driver marks it) and builds
the package with the weights left out of it (``aot_inductor.package_constants_in_so=False``: the
process already holds them). ``load`` loads the package, hands it the model's own weight tensors
(``load_constants(user_managed=True)``: no copy), runs one step, runs the eager step on the same
inputs and prints, as JSON, the wall and CPU seconds of each phase and whether every output tensor
of the package's step equals the eager one bit for bit.
"""

from __future__ import annotations

import time

PROCESS_START = (time.perf_counter(), time.process_time())

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

PROMPT = "The history of the Roman Empire is long and complicated. It began when"


def _since(start: tuple[float, float]) -> list[float]:
    """[wall, cpu] seconds since ``start``."""
    return [round(time.perf_counter() - start[0], 3), round(time.process_time() - start[1], 3)]


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _captured_step(fmt: str, phases: dict):
    """(model, step module over the flat tensors, the flat tensors of the first decode step)."""
    import torch

    import genfn
    from genfn import compile_boundary as boundary

    start = _now()
    model = genfn.load(quantize="gguf") if fmt == "q4_1" else genfn.load(dtype=getattr(torch, fmt))
    phases["load"] = _since(start)
    captured = {}

    def capture(model_, kind, step, state, compile_options, build):
        if "fn" not in captured:
            weights = boundary.ParamsModule(boundary.functional(model_).params)
            flat, layout = boundary._canonical_leaves(state)
            captured.update(fn=build(weights, layout), weights=weights, flat=flat)
        return captured["fn"]

    boundary._cached_compile = capture
    ids = torch.tensor([model.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        genfn.generate(model, ids, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                       cache_implementation="static", max_cache_len=128, pad_token_id=2)

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = captured["weights"]

        def forward(self, *flat):
            return captured["fn"](*flat)

    return model, Step(), captured["flat"]


def save(fmt: str, package: str) -> dict:
    import torch

    from genfn.torch_compat import dynamic_dims

    phases = {}
    _, step, flat = _captured_step(fmt, phases)
    start = _now()
    dims = tuple({d: torch.export.Dim.AUTO for d in dynamic_dims(t)} or None for t in flat)
    with torch.no_grad():
        exported = torch.export.export(step, tuple(flat), dynamic_shapes={"flat": dims}, strict=False)
    phases["export"] = _since(start)
    start = _now()
    torch._inductor.aoti_compile_and_package(exported, package_path=package,
                                             inductor_configs={"aot_inductor.package_constants_in_so": False})
    phases["aoti_build"] = _since(start)
    return phases


def load(fmt: str, package: str) -> dict:
    import torch

    phases = {"import_torch_and_genfn": _since(PROCESS_START)}
    _, step, flat = _captured_step(fmt, phases)
    start = _now()
    import torch._inductor

    phases["inductor_import"] = _since(start)
    start = _now()
    loaded = torch._inductor.aoti_load_package(package)
    # Tied weights are one tensor under two names: keep both (the package wants every name).
    buffers = dict(step.named_buffers(remove_duplicate=False))
    names = loaded.get_constant_fqns()
    missing = [name for name in names if name not in buffers]
    if missing:
        raise SystemExit(f"the package wants constants the model lacks: {missing[:5]}")
    loaded.load_constants({name: buffers[name] for name in names}, check_full_update=True, user_managed=True)
    phases["package_load"] = _since(start)
    with torch.no_grad():
        start = _now()
        packaged = loaded(*flat)
        phases["first_packaged_step"] = _since(start)
        start = _now()
        loaded(*flat)
        phases["second_packaged_step"] = _since(start)
        start = _now()
        eager = step(*flat)
        phases["eager_step"] = _since(start)
    phases["outputs_equal_eager"] = len(packaged) == len(eager) and all(
        torch.equal(a, b) for a, b in zip(packaged, eager))
    phases["since_start"] = _since(PROCESS_START)
    return phases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("save", "load"))
    ap.add_argument("--format", default="float32", choices=("float32", "bfloat16", "q4_1"))
    ap.add_argument("--package", required=True, help="the .pt2 file to write (save) or read (load)")
    args = ap.parse_args()
    phases = (save if args.mode == "save" else load)(args.format, args.package)
    print(json.dumps({"mode": args.mode, "format": args.format, "phases [wall s, cpu s]": phases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
