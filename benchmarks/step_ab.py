"""A/B of the compiled decode step before and after the leaner-step changes, in one process.

    GOMP_SPINCOUNT=1000 nice -n 15 python benchmarks/step_ab.py q8_0 1 repeat+walk,repeat,new

Variants (comma-separated, the first is the baseline of the ratios): ``repeat`` rebuilds the old
attention (K/V copied by repeat_interleave for each query group), ``walk`` the old rebuild of
params and state inside the step (torch's tree_unflatten over the treedef, one guard per field it
reads), ``new`` neither. Each variant is compiled first (run the script niced), then the script
takes /tmp/genfn-bench.lock, returns to normal priority and times the compiled steps interleaved:
``ROUNDS`` rounds of 10 calls each on the same state (env ``THREADS``, default 2).
"""
import os, sys, time, fcntl, inspect, statistics
from pathlib import Path
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import torch
from step_profile import load
from decode import batch_inputs
import genfn, genfn.driver as D, genfn.models.llama as L
import torch.utils._pytree as tp

dname, batch = sys.argv[1], int(sys.argv[2]); variants = sys.argv[3].split(",")
threads = int(os.environ.get("THREADS", "2"))
torch.set_num_threads(threads)
new_layer = L._decoder_layer
src = inspect.getsource(new_layer)
old_src = src.replace("attn_mask=mask, enable_gqa=grouped)", "attn_mask=mask)").replace(
    "    if output_attentions:\n        if grouped:", "    if grouped:\n        keys = keys.repeat_interleave(spec.num_query_groups, dim=1)\n        values = values.repeat_interleave(spec.num_query_groups, dim=1)\n    if output_attentions:\n        if False:")
ns = {}; exec(old_src, L.__dict__, ns); old_layer = ns["_decoder_layer"]
new_tree, new_join = D.ParamsModule.tree, D._layout_unflattener
def old_tree(self): return tp.tree_unflatten([getattr(self, f"p{i}") for i in range(self._count)], self._treedef)
def patch(v):
    L._decoder_layer = old_layer if "repeat" in v else new_layer
    D.ParamsModule.tree = old_tree if "walk" in v else new_tree
    D._layout_unflattener = (lambda layout: (lambda flat: D._join_leaves(flat, layout))) if "walk" in v else new_join
orig_call = D._call_on_leaves
steps = {}
for v in variants:
    patch(v)
    model = load(dname)
    ids, mask = batch_inputs(model.tokenizer, batch, pad_id=2)
    cap = {}
    def spy(fn, state, *lead):
        cap["a"] = (fn, state); return orig_call(fn, state, *lead)
    D._call_on_leaves = spy
    t = time.perf_counter()
    with torch.no_grad():
        genfn.generate(model, ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                       pad_token_id=2, cache_implementation="static", max_cache_len=256)
    D._call_on_leaves = orig_call
    fn, state = cap["a"]
    steps[v] = (fn, D._split_leaves(state)[0], model)
    print(f"# {v}: compiled in {time.perf_counter() - t:.0f} s", flush=True)
lock = open("/tmp/genfn-bench.lock", "w"); fcntl.flock(lock, fcntl.LOCK_EX)
try:
    os.nice(-os.nice(0))  # timed at normal priority (compiled niced)
except PermissionError:
    print("# could not return to normal priority: timings are niced")
print(f"# lock held; {dname} b={batch} threads {threads}; load avg {os.getloadavg()[0]:.2f}", flush=True)
times = {v: [] for v in variants}
with torch.no_grad():
    for v in variants:
        for _ in range(10): steps[v][0](*steps[v][1])
    for r in range(int(os.environ.get("ROUNDS", "12"))):
        for v in variants:
            fn, flat, _ = steps[v]
            t = time.perf_counter()
            for _ in range(10): fn(*flat)
            times[v].append((time.perf_counter() - t) / 10 * 1e3)
base = variants[0]
for v in variants:
    print(f"  {v:24s} best {min(times[v]):6.2f} ms/step  median {statistics.median(times[v]):6.2f}  "
          f"(best {min(times[base]) / min(times[v]):.3f}x of {base})")
print(f"# load avg {os.getloadavg()[0]:.2f}")
