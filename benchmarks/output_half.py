"""The fused layer's output half (``decode_layer_output_quant``) at a few tokens, split into its parts.

    python benchmarks/output_half.py                              # SmolLM2 Q4_1 blocks, 1,8,11 tokens, 1 and 2 threads
    python benchmarks/output_half.py --rows 11 --threads 1 --against main
    python benchmarks/output_half.py --model llama-1b-q4_0.gguf --rows 1 --threads 2 --against main

A verification round of prompt lookup sends a row's k + 1 tokens through every layer's output half
(attention over the cache, o projection and residual, MLP norm, gate/up, SwiGLU, down and residual)
in one call. Each case below is a pass over every layer of SmolLM2 (``genfn.load(quantize="gguf")``,
Q4_1 blocks; ``--model``: a GGUF file of Q8_0/Q4_0/Q4_1 layers), so that the weights come from memory
as they do in a round, or, with ``--in-cache``, layer 0's weights as many times. The ways, timed in turn ``--calls`` times so that a burst of load hits
them alike (the fastest pass counts, printed per layer in us, and as G int8 multiply-adds a second
over the three linears' weights):

- ``layer``: the op, each token attending ``--span`` slots less the drafts after it (a round's mask);
- ``layer, 1 slot``: the same with each token attending one slot: the difference is the attention;
- ``linears``: the three linears alone through ``quant_linear`` (a parallel region each);
- ``attention``: ``dense_decode_attention`` of the same tokens over the same cache;
- with ``--against REV``: ``layer`` of the kernels built from git revision REV (``genfn.bench.revision_kernels``),
  in the same loop, so that the ratio survives a noisy machine; the two layers' outputs must be equal bit for bit.
"""

from __future__ import annotations

import argparse
import os

import torch

import genfn
from genfn import driver
from genfn.bench.timing import interleaved


def rows_case(spec, rows: int, span: int, slots: int = 512):
    """Inputs of one call of ``rows`` tokens of one cache row: x, q, keys, values, the round's mask, a one-slot mask."""
    torch.manual_seed(rows)
    hidden, heads, kv_heads, head_dim = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    x = torch.randn(rows, hidden)
    q = torch.randn(rows, heads, head_dim)
    keys, values = torch.randn(2, 1, kv_heads, slots, head_dim)
    visible = torch.zeros(rows, span, dtype=torch.bool)  # the driver limits the mask to the row's span
    for m in range(rows):  # token m sees the cache before the round and the round's tokens up to itself
        visible[m, :span - rows + m + 1] = True
    one_slot = torch.zeros_like(visible)
    one_slot[:, 0] = True
    return x, q, keys, values, visible, one_slot


def ways(ops, baseline, layers, spec, case):
    x, q, keys, values, visible, one_slot = case
    eps, scale = spec.rms_norm_eps, spec.head_dim ** -0.5
    rows = x.shape[0]
    attn = q.reshape(rows, -1).contiguous()
    ffn = layers[0]["w_down"].in_features
    act = torch.randn(rows, ffn)
    expanded_keys, expanded_values = keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1)

    def parts(w):
        return w.codes, w.scales, w.mins, w.kind

    def layer(namespace, mask):
        def run():
            for lay in layers:
                out = namespace.decode_layer_output_quant(x, q, keys, values, mask, *parts(lay["wo"]),
                                                          lay["mlp_norm"], *parts(lay["w_gate_up"]),
                                                          *parts(lay["w_down"]), eps, scale)
            return out
        return run

    def linears():
        for lay in layers:
            for w, inputs in ((lay["wo"], attn), (lay["w_gate_up"], x), (lay["w_down"], act)):
                ops.quant_linear(inputs, *parts(w), w.out_features)

    def attention():
        for _ in layers:
            ops.dense_decode_attention(q, expanded_keys, expanded_values, visible, scale)

    found = {"layer": layer(ops, visible), "layer, 1 slot": layer(ops, one_slot), "linears": linears,
             "attention": attention}
    if baseline is not None:
        found["layer (against)"] = layer(baseline, visible)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,11", help="comma-separated tokens a call")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--span", type=int, default=136, help="slots the round's last token attends (the lookup_steps round's)")
    parser.add_argument("--calls", type=int, default=40, help="passes of each way (the fastest counts)")
    parser.add_argument("--in-cache", action="store_true", help="layer 0's weights once a layer, not every layer's")
    parser.add_argument("--model", default=None, help="a GGUF file of Q8_0/Q4_0/Q4_1 layers (default: the embedded SmolLM2)")
    parser.add_argument("--against", default=None, help="a git revision whose kernels' layer to time beside")
    args = parser.parse_args()
    model = genfn.load(args.model, quantize="gguf") if args.model else genfn.load(quantize="gguf")
    params, spec = driver.functional(model).params, model.spec
    layers = [params["layers"][0]] * len(params["layers"]) if args.in_cache else list(params["layers"])
    ops = torch.ops.genfn_kernels
    baseline = None
    if args.against:
        from genfn.bench.revision_kernels import build_at_revision
        from genfn.kernels import native

        torch.ops.load_library(str(build_at_revision(native.DECODE, args.against,
                                                     {"genfn_kernels": "genfn_baseline"})))
        baseline = torch.ops.genfn_baseline
    macs = sum(lay[n].out_features * lay[n].in_features for lay in layers[:1] for n in ("wo", "w_gate_up", "w_down"))
    n = len(params["layers"])
    print(f"# output half, {f'layer 0 x {n} (in cache)' if args.in_cache else f'{n} layers'}, span {args.span}, "
          f"fastest of {args.calls} passes, load {os.getloadavg()[0]:.2f}" +
          (f", against {args.against}" if args.against else ""))
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            calls = ways(ops, baseline, layers, spec, rows_case(spec, rows, args.span))
            with torch.no_grad():
                best = {name: min(seconds) for name, (_, seconds) in interleaved(calls, args.calls).items()}
            if baseline is not None:  # the same bits as the other revision's layer
                one = layers[:1]
                mine = ways(ops, None, one, spec, rows_case(spec, rows, args.span))
                theirs = ways(baseline, None, one, spec, rows_case(spec, rows, args.span))
                assert torch.equal(mine["layer"](), theirs["layer"]()), "the layers' outputs differ"
            cells = "  ".join(f"{name} {best[name] / len(layers) * 1e6:6.1f}" for name in calls)
            rate = rows * macs / (best["layer"] / len(layers)) / 1e9
            extra = (f"  layer / against {best['layer'] / best['layer (against)']:.3f}"
                     if "layer (against)" in best else "")
            print(f"threads {threads} rows {rows:2d}: us a layer  {cells}  ({rate:5.1f} G MAC/s){extra}",
                  flush=True)


if __name__ == "__main__":
    main()
