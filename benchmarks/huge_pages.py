"""Weights on huge pages (genfn.models.weight_arena) against the same weights on 4 KiB pages, in one process.

    python benchmarks/huge_pages.py                       # q4_1,q8_0,bfloat16,float32 at batch 1
    python benchmarks/huge_pages.py --formats bfloat16 --batch 8

First the read bandwidth: ``tensor.sum()`` over 212 MB in an ordinary allocation and in one
advised for huge pages. Then per format: SmolLM2 loaded as ``genfn.load`` does (its weights in the
huge-page arena) and a copy of it whose every weight is cloned into an ordinary allocation; both
compiled, then ``ROUNDS`` (env, default 8) rounds alternating the two, each a static-cache greedy
``generate`` of ``--new-tokens`` tokens. Prints the median ms per token of each, their ratio, how
many MiB of the arena the kernel backed with huge pages, and whether the tokens are equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import optree  # noqa: E402
import torch  # noqa: E402

from genfn.bench.decode import batch_inputs  # noqa: E402
from step_profile import load  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "8"))


def _on_small_pages(model):
    """The same model with every weight cloned into its own ordinary (4 KiB-page) allocation."""
    from genfn.models.model import Model
    from genfn.state.base import NAMESPACE

    params = optree.tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, model.params,
                             none_is_leaf=True, namespace=NAMESPACE)
    return Model(model.spec, params, model.apply_fn, model.init_cache_fn, tokenizer=model.tokenizer,
                 generation_config=model.generation_config, config=dict(model.config), source=model.source)


def bandwidth() -> None:
    from genfn.models.weight_arena import place_in_arena

    nbytes = 212 * 2 ** 20
    small = torch.ones(nbytes // 4)
    huge = place_in_arena({"x": torch.ones(nbytes // 4)})["x"]
    times = {"4 KiB pages": [], "huge pages": []}
    for _ in range(15):
        for name, t in (("4 KiB pages", small), ("huge pages", huge)):
            start = time.perf_counter()
            t.sum()
            times[name].append(time.perf_counter() - start)
    print("# read bandwidth, tensor.sum() over 212 MiB: " + ", ".join(
        f"{name} {nbytes / statistics.median(v) / 1e9:.1f} GB/s" for name, v in times.items()))


def compare(dname: str, batch: int, new_tokens: int) -> None:
    import genfn
    from genfn.models.weight_arena import huge_page_bytes
    from genfn.state.base import tree_flatten

    arena = load(dname)
    small = _on_small_pages(arena)
    first = next(leaf for leaf in tree_flatten(arena.params)[0] if isinstance(leaf, torch.Tensor))
    ids, mask = batch_inputs(arena.tokenizer, batch, pad_id=2)
    models = {"huge pages": arena, "4 KiB pages": small}

    def run(model):
        with torch.no_grad():
            return genfn.generate(model, ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=2,
                                  cache_implementation="static")

    tokens = {name: run(model) for name, model in models.items()}  # compiles both
    per_token = {name: [] for name in models}
    for _ in range(ROUNDS):
        for name, model in models.items():
            start = time.perf_counter()
            run(model)
            per_token[name].append((time.perf_counter() - start) / new_tokens * 1e3)
    med = {name: statistics.median(v) for name, v in per_token.items()}
    print(f"{dname:9s} batch {batch}: huge pages {med['huge pages']:6.2f} ms/token, 4 KiB pages "
          f"{med['4 KiB pages']:6.2f} ms/token, speed-up {med['4 KiB pages'] / med['huge pages']:.3f}x; "
          f"arena on huge pages {huge_page_bytes(first) / 2 ** 20:.0f} MiB; tokens equal "
          f"{torch.equal(tokens['huge pages'], tokens['4 KiB pages'])}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="q4_1,q8_0,bfloat16,float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from genfn.models.weight_arena import huge_pages_available

    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read().strip()
    print(f"# transparent_hugepage: {mode}; genfn asks for huge pages: {huge_pages_available()}; "
          f"{ROUNDS} rounds alternating; load avg {os.getloadavg()[0]:.2f}", flush=True)
    bandwidth()
    for dname in args.formats.split(","):
        compare(dname, args.batch, args.new_tokens)


if __name__ == "__main__":
    main()
