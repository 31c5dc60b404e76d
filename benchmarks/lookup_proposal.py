"""Prompt lookup's proposal alone: the native scan (``lookup_ops.cpp``) against the tensor ops.

    python benchmarks/lookup_proposal.py --width 520 --cur-len 300 --lookup-tokens 3,7

One row of random tokens (no n-gram repeats, so every window is compared), the calls alternated,
best of ``--calls``; what an eager round pays for its proposal either way (a compiled step fuses the
tensor ops).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from genfn.strategies.assisted.prompt_lookup import _propose_with_tensor_ops, propose_prompt_lookup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=520, help="columns of the token buffer")
    parser.add_argument("--cur-len", type=int, default=300, help="filled columns")
    parser.add_argument("--lookup-tokens", default="3,7")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    tokens = torch.randint(0, 49152, (1, args.width), generator=torch.Generator().manual_seed(0))
    cur_len, first, max_length = torch.tensor([args.cur_len]), torch.tensor([0]), torch.tensor([args.width - 8])
    for k in (int(v) for v in args.lookup_tokens.split(",")):
        ways = {
            "native": lambda: propose_prompt_lookup(tokens, cur_len, k, 2, eos_token_ids=(2,), max_length=max_length,
                                                    first_column=first),
            "tensor-ops": lambda: _propose_with_tensor_ops(tokens, cur_len, k, 2, "latest", (2,), max_length, first),
        }
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(args.calls):
            for name, call in ways.items():
                start = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - start)
        print(json.dumps({"k": k, "threads": torch.get_num_threads(),
                          **{f"{name}_us": round(t * 1e6, 1) for name, t in best.items()}}), flush=True)


if __name__ == "__main__":
    main()
