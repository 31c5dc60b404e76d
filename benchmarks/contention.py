"""OpenMP wait policy vs decode speed, on a quiet machine and beside a competing process.

    flock /tmp/genfn-bench.lock timeout 900 python benchmarks/contention.py
    flock /tmp/genfn-bench.lock timeout 900 python benchmarks/contention.py --format float32 --threads 2,1
    flock /tmp/genfn-bench.lock timeout 900 python benchmarks/contention.py --policies default,passive,genfn

torch here runs on GNU OpenMP (libgomp), whose idle threads spin ``GOMP_SPINCOUNT`` iterations
(300 000 unless set) before they sleep; ``OMP_WAIT_POLICY=PASSIVE`` sleeps at once. libgomp reads
these when it loads, so every policy runs in its own fresh process. Policies (``--policies``):

    default    OpenMP's own (``GENFN_WAIT_POLICY=default`` stops genfn from setting its choice)
    passive    ``OMP_WAIT_POLICY=PASSIVE``
    spin<N>    ``GOMP_SPINCOUNT=N`` (e.g. spin1000, spin10000, spin100000)
    genfn      ``GENFN_WAIT_POLICY=auto``: what genfn's command line chooses (``genfn.wait_policy``)
    hf         not genfn: transformers' default ``generate`` (dynamic cache, eager) on the same
               weights in float32, under OpenMP's own policy, as a transformers user runs it
               (``--format float32`` only: the other formats are genfn's)

With an ``hf`` row the table ends with genfn's speed relative to transformers, quiet and loaded, per
genfn policy: issue 31's bar is that the loaded ratio stays within 1.5x of the quiet one.

Each process loads the model (``--format``: ``q4_1``, the shipped GGUF's own blocks, or
``float32``/``bfloat16``), compiles the decode step (static cache; the on-disk compile caches
are shared, so only the first process compiles cold), and then alternates ``--repeats`` times:
decode quiet, decode beside ``--competitors`` busy-loop processes (pure Python ``while True``,
one per competitor, free to run on any core; killed right after). tok/s is per decoded token
with the prefill subtracted: (time(1 + n tokens) - time(1 token)) / n, best of the repeats.
Tokens are checked equal across policies (the policy must never change what is generated).

Prints a table (tok/s quiet, loaded, loaded / passive's loaded, quiet / default's quiet) and the
policy genfn chooses, and writes JSON to ``benchmarks/results/contention-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from genfn.bench.results import write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The history of the Roman Empire is long and complicated. It began when"
CHILD_TIMEOUT_S = 600
_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "GENFN_WAIT_POLICY")


def policy_env(policy: str) -> dict:
    """Environment variables of a policy name (see the module docstring)."""
    if policy == "default":
        return {"GENFN_WAIT_POLICY": "default"}
    if policy == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    if policy == "genfn":
        return {"GENFN_WAIT_POLICY": "auto"}
    if policy == "hf":
        return {}
    if policy.startswith("spin") and policy[4:].isdigit():
        return {"GOMP_SPINCOUNT": policy[4:]}
    raise ValueError(f"--policies: unknown policy {policy!r}; use default, passive, genfn, hf or spin<N> (spin10000)")


def busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        p.kill()
    for p in processes:
        p.wait(timeout=30)


def child(args) -> dict:
    """The measured process: tok/s quiet and loaded under the policy its environment holds."""
    import genfn  # first: with GENFN_WAIT_POLICY=auto genfn sets its policy only before torch loads OpenMP
    import torch
    from genfn import wait_policy

    torch.set_num_threads(args.threads)

    if args.engine == "hf":
        from transformers import AutoModelForCausalLM

        from genfn.default_model import default_model_path

        path = Path(default_model_path())
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        ids = torch.tensor([genfn.load(quantize="gguf").tokenizer.encode(PROMPT)])

        def generate(n):
            t = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=2)
            return time.perf_counter() - t, out
    else:
        model = (genfn.load(quantize="gguf") if args.format == "q4_1"
                 else genfn.load(dtype=getattr(torch, args.format)))
        ids = torch.tensor([model.tokenizer.encode(PROMPT)])

        def generate(n):
            t = time.perf_counter()
            with torch.no_grad():
                out = genfn.generate(model, ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     cache_implementation="static", max_cache_len=256, pad_token_id=2)
            return time.perf_counter() - t, out

    t = time.perf_counter()
    _, tokens = generate(args.new_tokens + 1)
    warmup_s = time.perf_counter() - t

    def tok_s(n):
        return n / max(generate(n + 1)[0] - generate(1)[0], 1e-9)

    quiet, loaded = [], []
    for _ in range(args.repeats):
        quiet.append(tok_s(args.new_tokens))
        competitors = busy_loops(args.competitors)
        try:
            time.sleep(0.5)  # let the competitors reach their loops
            loaded.append(tok_s(args.loaded_tokens))
        finally:
            stop(competitors)
    return {"quiet_tok_s": max(quiet), "loaded_tok_s": max(loaded), "quiet_all": quiet, "loaded_all": loaded,
            "warmup_s": warmup_s, "policy_in_effect": wait_policy.wait_policy(),
            "threads": torch.get_num_threads(), "tokens": tokens[0, ids.shape[1]:].tolist(),
            "env": {k: os.environ.get(k) for k in _POLICY_VARS if os.environ.get(k)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="default,passive,spin100,spin1000,spin10000,genfn")
    ap.add_argument("--threads", default="2", help="comma-separated torch.set_num_threads values")
    ap.add_argument("--format", default="q4_1", choices=("q4_1", "float32", "bfloat16"))
    ap.add_argument("--competitors", type=int, default=1, help="busy-loop processes beside the loaded runs")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per quiet timing")
    ap.add_argument("--loaded-tokens", type=int, default=16, help="tokens per loaded timing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="genfn", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        args.threads = int(args.threads)
        print(json.dumps(child(args)))
        return 0
    try:
        policies = [(p, policy_env(p)) for p in args.policies.split(",") if p]
        threads = [int(t) for t in args.threads.split(",") if t]
    except ValueError as error:
        ap.error(str(error))
    if any(name == "hf" for name, _ in policies) and args.format != "float32":
        ap.error("--policies hf runs transformers on float32 weights: use --format float32 with it")

    def log(line=""):
        print(line, flush=True)

    log(f"# genfn contention benchmark: {args.format}, compiled step, {args.competitors} busy-loop competitor(s)  "
        f"uptime: {os.popen('uptime').read().strip()}")
    base = {k: v for k, v in os.environ.items() if k not in _POLICY_VARS}
    base.update(PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), TOKENIZERS_PARALLELISM="false")
    rows = []
    for n_threads in threads:
        for name, env in policies:
            cmd = [sys.executable, __file__, "--child", "--threads", str(n_threads), "--format", args.format,
                   "--engine", "hf" if name == "hf" else "genfn",
                   "--competitors", str(args.competitors), "--new-tokens", str(args.new_tokens),
                   "--loaded-tokens", str(args.loaded_tokens), "--repeats", str(args.repeats)]
            done = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            if done.returncode != 0:
                log(f"{name:12s} threads {n_threads}: FAILED {done.stderr.strip().splitlines()[-3:]}")
                continue
            row = {"policy": name, **json.loads(done.stdout.strip().splitlines()[-1])}
            rows.append(row)
            log(f"{name:12s} threads {n_threads}: quiet {row['quiet_tok_s']:6.1f} tok/s  loaded {row['loaded_tok_s']:6.1f}"
                f"  (warm-up {row['warmup_s']:.0f} s; {row['policy_in_effect']})")
    log(f"# uptime at end: {os.popen('uptime').read().strip()}")

    def find(policy, n_threads):
        return next((r for r in rows if r["policy"] == policy and r["threads"] == n_threads), None)

    log()
    log("| policy | threads | quiet tok/s | loaded tok/s | loaded / passive loaded | quiet / default quiet |")
    log("|---|---|---|---|---|---|")
    for row in rows:
        passive, default = find("passive", row["threads"]), find("default", row["threads"])
        vs_passive = f"{row['loaded_tok_s'] / passive['loaded_tok_s']:.2f}" if passive else "—"
        vs_default = f"{row['quiet_tok_s'] / default['quiet_tok_s']:.2f}" if default else "—"
        log(f"| {row['policy']} | {row['threads']} | {row['quiet_tok_s']:.1f} | {row['loaded_tok_s']:.1f} | "
            f"{vs_passive} | {vs_default} |")
    for row in rows:
        hf = find("hf", row["threads"])
        if hf and row["policy"] != "hf":
            quiet, loaded = row["quiet_tok_s"] / hf["quiet_tok_s"], row["loaded_tok_s"] / hf["loaded_tok_s"]
            log(f"genfn ({row['policy']}) / transformers, threads {row['threads']}: quiet {quiet:.2f}x, loaded "
                f"{loaded:.2f}x: loaded it keeps {loaded / quiet:.2f} of its quiet lead (bar: >= {1 / 1.5:.2f})")
    differ = [r["policy"] for r in rows if rows and r["tokens"] != rows[0]["tokens"]]
    log(f"tokens equal across policies: {'yes' if not differ else 'NO, differ: ' + ', '.join(differ)}")
    from_genfn = [r["policy_in_effect"] for r in rows if r["policy"] == "genfn"]
    log(f"policy genfn's command line chooses when nothing is set: {from_genfn[0] if from_genfn else '(genfn row not run)'}")
    out = write_results("contention", {"args": vars(args), "load_avg_end": os.getloadavg(), "rows": rows}, args.out)
    log(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
