"""One mixture-of-experts MLP at batch 1: genfn's moe_decode kernel (chosen experts only) against
the dense formulation (every expert, unchosen ones weighted zero), side by side in one process.

    python benchmarks/moe_decode.py
"""
import time, torch
from genfn.models.moe import moe_mlp
from genfn import kernels
assert kernels.decode_linear_available()
torch.manual_seed(0)
E, k, H, I = 32, 4, 1024, 768
class Spec: experts_per_token, norm_topk_prob = k, True
layer = {"router": torch.randn(E, H), "experts_gate_up": torch.randn(E, 2 * I, H) / 30, "experts_down": torch.randn(E, H, I) / 30}
x = torch.randn(1, 1, H)
def dense(x):
    import genfn.models.moe as m
    saved = m.native_moe_takes
    m.native_moe_takes = lambda *a: False
    try: return moe_mlp(Spec, layer, x)
    finally: m.native_moe_takes = saved
with torch.no_grad():
    a, b = moe_mlp(Spec, layer, x), dense(x)
    print("max diff", (a - b).abs().max().item())
    for name, f in (("native", lambda: moe_mlp(Spec, layer, x)), ("dense", lambda: dense(x))) * 2:
        f(); t = time.perf_counter()
        for _ in range(20): f()
        print(name, f"{(time.perf_counter() - t) / 20 * 1e3:.2f} ms")
print("expert bytes all:", E * 3 * H * I * 4 / 1e6, "MB; chosen:", k * 3 * H * I * 4 / 1e6, "MB")
