"""One mixture-of-experts MLP at batch 1: genfn's ``moe_decode`` kernel (the chosen experts only)
against the dense formulation (every expert, the unchosen ones weighted zero), interleaved in one
process so a busy machine slows both alike. Prints each run's time and the bytes each reads.

    python benchmarks/moe_decode.py [--experts 32 --top-k 4 --hidden 1024 --inter 768]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from genfn import kernels
from genfn.models.moe import moe_mlp, route


def dense(layer, x, top_k):
    weights, experts = route(x, layer["router"], top_k, True)
    out = torch.zeros_like(x)
    for e in range(layer["experts_gate_up"].shape[0]):
        gate, up = F.linear(x, layer["experts_gate_up"][e]).chunk(2, dim=-1)
        out = out + F.linear(F.silu(gate) * up, layer["experts_down"][e]) * (weights * (experts == e)).sum(-1, True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not kernels.decode_linear_available():
        raise SystemExit(f"native kernels unavailable: {kernels.kernel_status()}")
    torch.manual_seed(0)
    e, k, h, i = args.experts, args.top_k, args.hidden, args.inter
    layer = {"router": torch.randn(e, h), "experts_gate_up": torch.randn(e, 2 * i, h) / 30,
             "experts_down": torch.randn(e, h, i) / 30}

    class Spec:
        experts_per_token, norm_topk_prob = k, True

    x = torch.randn(1, h)
    with torch.no_grad():
        print("max |native - dense|:", (moe_mlp(Spec, layer, x) - dense(layer, x, k)).abs().max().item())
        for _ in range(2):
            for name, run in (("native", lambda: moe_mlp(Spec, layer, x)), ("dense", lambda: dense(layer, x, k))):
                run()
                start = time.perf_counter()
                for _ in range(args.repeats):
                    run()
                print(f"{name}: {(time.perf_counter() - start) / args.repeats * 1e3:.2f} ms")
    print(f"expert bytes: all {e * 3 * h * i * 4 / 1e6:.1f} MB, chosen {k * 3 * h * i * 4 / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
