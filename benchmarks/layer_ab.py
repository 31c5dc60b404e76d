"""The native decoder layer (genfn.kernels.decode_layer) against the op-by-op layer, in one process.

    python benchmarks/layer_ab.py step bfloat16 1        # compiled decode step, native vs op by op
    python benchmarks/layer_ab.py layers bfloat16        # SmolLM2's 30 layers: native calls vs their linears
    EAGER=1 python benchmarks/layer_ab.py step /work/models-tmp/llama-1b-q4_k_m.gguf 1   # a GGUF file, eager

``step``: SmolLM2 in the given format and batch size, ``genfn.generate(cache_implementation="static")``
of 64 greedy tokens with the native layer and with it refused (``decode_layer.takes`` patched),
each compiled first, then ``ROUNDS`` (env, default 12) rounds alternating the two; prints the median
and 10th percentile of the compiled step's wall time and the median generate time per token. The
format may be a GGUF file's path (loaded with ``quantize="gguf"``); ``EAGER=1`` runs the static
cache's steps eagerly (no compiled step to time: generate's time per token only); ``LOOKUP=N``
drafts up to N tokens by prompt lookup (a repetitive prompt), each round one verification.

``layers``: one decode row through all 30 layers, three ways alternated ``ROUNDS`` times: the two
native calls per layer; only the four ``decode_linear`` calls per layer (no attention, norms or
residuals); ``tensor.sum()`` over the same weights. Prints ms per pass and GB/s of weight: how close
the layer is to streaming its weights, and to the read bandwidth.
"""

from __future__ import annotations

import os
import statistics
import sys
import time


import torch  # noqa: E402

from genfn.bench.decode import batch_inputs  # noqa: E402
from step_profile import load  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "12"))


def step_ab(dname: str, batch: int) -> None:
    import genfn
    import genfn.driver as driver
    from genfn.kernels import decode_layer

    model = genfn.load(dname, quantize="gguf") if dname.endswith(".gguf") else load(dname)
    ids, mask = batch_inputs(model.tokenizer, batch, pad_id=2)
    new_tokens = 64
    eager, lookup = os.environ.get("EAGER") == "1", int(os.environ.get("LOOKUP", "0"))
    extra = {"disable_compile": True} if eager else {}
    if lookup:
        ids = ids[:, -8:].repeat(1, 4)
        mask = torch.ones_like(ids)
        extra["prompt_lookup_num_tokens"] = lookup
    step_times: list[float] = []
    compiled_step = driver.compiled_step

    def timed_compiled_step(*args, **kwargs):
        step = compiled_step(*args, **kwargs)

        def call(state):
            start = time.perf_counter()
            out = step(state)
            step_times.append(time.perf_counter() - start)
            return out

        return call

    driver.compiled_step = timed_compiled_step
    native = decode_layer.takes

    def refused(*args):
        return False

    variants = {"native": native, "op-by-op": refused}

    def run():
        with torch.no_grad():
            return genfn.generate(model, ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=2,
                                  cache_implementation="static", max_cache_len=256, **extra)

    tokens = {}
    for name, takes in variants.items():  # compile both
        decode_layer.takes = takes
        tokens[name] = run()
    steps = {name: [] for name in variants}
    per_token = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, takes in variants.items():
            decode_layer.takes = takes
            step_times.clear()
            start = time.perf_counter()
            run()
            per_token[name].append((time.perf_counter() - start) / new_tokens * 1e3)
            steps[name] += step_times
    decode_layer.takes = native
    print(f"# {dname} batch {batch}{' eager' if eager else ''}{f' lookup {lookup}' if lookup else ''}, "
          f"{ROUNDS} rounds of {new_tokens} tokens; tokens equal: "
          f"{torch.equal(tokens['native'], tokens['op-by-op'])}")
    for name in variants:
        s = sorted(steps[name]) or [float("nan")]
        print(f"  {name:9s} step median {s[len(s) // 2] * 1e3:6.2f} ms  p10 {s[len(s) // 10] * 1e3:6.2f}  "
              f"generate median {statistics.median(per_token[name]):6.2f} ms/token")


def layers_ab(dname: str) -> None:
    import genfn.driver as driver

    dtype = getattr(torch, dname)
    model = load(dname)
    params = driver.functional(model).params
    spec = model.spec
    ops = torch.ops.genfn_kernels
    heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    span = 80
    x = torch.randn(1, spec.hidden_size, dtype=dtype)
    q = torch.randn(1, heads, head_dim, dtype=dtype)
    keys = torch.randn(1, kv_heads, 256, head_dim, dtype=dtype)[:, :, :span]
    values = torch.randn(1, kv_heads, 256, head_dim, dtype=dtype)[:, :, :span]
    visible = torch.ones(1, span, dtype=torch.bool)
    cos, sin = torch.randn(1, head_dim, dtype=dtype), torch.randn(1, head_dim, dtype=dtype)
    ffn = params["layers"][0]["w_down"].shape[1]
    act = torch.randn(1, ffn, dtype=dtype)
    names = ("wqkv", "wo", "w_gate_up", "w_down")

    def native():
        for layer in params["layers"]:
            ops.decode_attention_input(x, layer["attn_norm"], layer["wqkv"], cos, sin, spec.rms_norm_eps, heads,
                                       kv_heads)
            ops.decode_layer_output(x, q, keys, values, visible, layer["wo"], layer["mlp_norm"], layer["w_gate_up"],
                                    layer["w_down"], spec.rms_norm_eps, head_dim ** -0.5)

    def linears():
        for layer in params["layers"]:
            ops.decode_linear(x, layer["wqkv"])
            ops.decode_linear(q.reshape(1, -1), layer["wo"])
            ops.decode_linear(x, layer["w_gate_up"])
            ops.decode_linear(act, layer["w_down"])

    def sums():
        for layer in params["layers"]:
            for name in names:
                layer[name].sum()

    ways = {"native layer": native, "its linears": linears, "sum()": sums}
    times = {name: [] for name in ways}
    for _ in range(ROUNDS):
        for name, way in ways.items():
            start = time.perf_counter()
            for _ in range(5):
                way()
            times[name].append((time.perf_counter() - start) / 5)
    weight_bytes = sum(layer[n].numel() * layer[n].element_size() for layer in params["layers"] for n in names)
    print(f"# {dname}: {len(params['layers'])} layers, {weight_bytes / 1e6:.0f} MB of weights, {ROUNDS} rounds")
    for name in ways:
        best = statistics.median(times[name])
        print(f"  {name:13s} {best * 1e3:7.3f} ms  {weight_bytes / best / 1e9:5.1f} GB/s")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        raise SystemExit(print(__doc__))
    if len(argv) < 2 or argv[0] not in ("step", "layers"):
        raise SystemExit(__doc__)
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    if argv[0] == "step":
        step_ab(argv[1], int(argv[2]) if len(argv) > 2 else 1)
    else:
        layers_ab(argv[1])


if __name__ == "__main__":
    main()
