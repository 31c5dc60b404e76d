"""Random tiny model shapes through genfn's decode paths, each against an oracle: a correctness sweep.

    python benchmarks/shape_sweep.py                                # every path, 12 shapes each
    python benchmarks/shape_sweep.py --paths eager --shapes 40 --seed 7
    python benchmarks/shape_sweep.py --paths batching,families --shapes 20

The native decode (``genfn.kernels``) holds fixed-size registers and buffers (attention groups,
row groups, thread runs) and takes the shapes it can and leaves the rest to the op-by-op layers. The
test suite pins a few shapes; this draws many: head dims 16-128, 1-16 query heads a kv head, widths
on and off the block formats' sizes (such linears stay float), 1-3 layers, left-padded rows, 1 and 2
threads. Paths (``--paths``):

``eager``     a Llama: ``generate`` (static cache) against transformers' greedy tokens in float32,
              and in each block format (``--formats``) the native stack against the layers one by one
              and each padded row against its prompt alone (tokens and logits, bit for bit); prompt
              lookup at a random k against plain greedy beside each
``compiled``  a Llama in float32 or bfloat16: the compiled step with the native stack against the
              compiled op-by-op layers (tokens and logits)
``families``  Mistral and Gemma 2/3 (short sliding windows), Qwen2, Qwen3, Phi-3, Qwen3-MoE, Llama:
              ``generate`` (static and dynamic cache) against transformers, then ``generate_batch``
``batching``  a Llama in a random format: ``generate_batch`` (chunked prefill on or off; greedy, beam
              search, prompt lookup or seeded sampling) against ``generate`` one prompt at a time

Prints a line per shape and a count of failures; exits 1 if any shape failed. Timing is no part of
it. In session 31 it found three bugs, since fixed (docs/measurements/scale-sessions.md, *Session 31*):
``generate_batch`` with chunked prefill off failing its own long prompts, the same beside speculative
requests, and multi-query models' batched requests leaving ``generate``'s bits.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from genfn.bench.tiny_models import tiny_pair

BLOCK_FORMATS = ("q4_0", "q8_0", "q4_1", "q5_0", "q5_1")
K_FORMATS = ("q4_k", "q5_k_r8", "q6_k", "iq4_xs", "q4_k_m")
# A Q4_K_M file's layer as the GGUF loader keeps it: q and k in Q4_K beside v in Q6_K (one RowStack),
# the output projection in Q5_K, gate and up in Q4_K rows interleaved 8 to a group, down in Q6_K.
Q4_K_M = {"wq_k": "q4_k_r8", "wv": "q6_k", "wo": "q5_k", "w_gate_up": "q4_k_r8", "w_down": "q6_k"}
FAMILIES = ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM",
            "Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM")
LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")
VOCAB = 97  # the tiny models' vocabulary (genfn.bench.tiny_models)
NEW_TOKENS = 6


def draw_shape(rng: random.Random, group_sizes=(1, 2, 3, 4, 5, 7, 8, 9, 12, 16)) -> dict:
    """A Llama-style shape: the hidden size a multiple of the head count (transformers checks it)."""
    kv_heads = rng.choice([1, 2, 3, 4, 5])
    heads = kv_heads * rng.choice(group_sizes)
    wide = [256, 512, 768, 1024] if rng.random() < 0.6 else [64, 96, 160, 320, 384, 480]
    hidden = rng.choice([h for h in wide if h % heads == 0] or [heads * 16])
    return dict(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=hidden,
                head_dim=rng.choice([16, 32, 48, 64, 80, 96, 112, 128]),
                intermediate_size=rng.choice([96, 256, 352, 512]), num_hidden_layers=rng.choice([1, 2, 3]))


def padded_prompts(rng: random.Random, seed: int, batch: int, length: int = 7):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, : (row * 2) % (length - 1)] = 0
    return ids * mask, mask


def in_format(model, fmt: str):
    """``model`` with its layers' linears in ``fmt``: a block format (a linear whose inputs are no
    multiple of 32 stays float), or a K-quant format or mix (a linear whose inputs are no multiple of
    256 in llama.cpp's fallback, Q5_0, Q5_1 or Q8_0; of 32 neither, float)."""
    from genfn.models.model import Model
    from genfn.models.quantized import quantize_params
    from genfn.quant.kquants import quantize_k
    from genfn.quant.blocks import quantize
    from genfn.quant.stack import RowStack
    from genfn.quant.weight import QuantizedWeight

    if fmt == "f32":
        return model
    if fmt in BLOCK_FORMATS:
        params = quantize_params(model.params, fmt)
    else:
        def convert(w, fmt):
            # llama.cpp's quantizer writes a matrix whose inputs are no multiple of 256 in a block
            # format instead (Q4_K's as Q5_0, Q5_K's as Q5_1, the others' as Q8_0; a q/k/v whose
            # parts differ stays a RowStack of tiles here): a float matrix would run torch's GEMM,
            # whose sums depend on the row count (docs/guides/determinism.md), where every kernel here does not.
            if w.shape[1] % 256:
                fallback = "q5_0" if fmt.startswith("q4_k") else "q5_1" if fmt.startswith("q5_k") else "q8_0"
                return QuantizedWeight.from_rows(quantize(w, fallback)) if w.shape[1] % 32 == 0 else w
            if fmt.endswith("_r8") and w.shape[0] % 8:
                fmt = fmt[:-len("_r8")]
            return quantize_k(w, fmt)

        def layer_in_format(layer):
            if fmt != "q4_k_m":
                return {k: convert(v, fmt) if k in LINEARS else v for k, v in layer.items()}
            v_rows = model.spec.num_kv_heads * model.spec.head_dim
            q_k, v = layer["wqkv"][:-v_rows], layer["wqkv"][-v_rows:]
            q_k, v = convert(q_k, Q4_K_M["wq_k"]), convert(v, Q4_K_M["wv"])
            wqkv = RowStack((q_k, v))
            return dict(layer, wqkv=wqkv, **{k: convert(layer[k], Q4_K_M[k]) for k in ("wo", "w_gate_up", "w_down")})

        layers = [layer_in_format(layer) for layer in model.params["layers"]]
        params = dict(model.params, layers=layers)
    return Model(model.spec, params, model.apply_fn, model.init_cache_fn)


def all_quantized(model) -> bool:
    """Whether every layer linear of ``model`` is quantized (no float matrix through torch's GEMM)."""
    return not any(isinstance(layer[k], torch.Tensor) for layer in model.params["layers"] for k in LINEARS)


def generate(model, ids, mask, *, native: bool = True, compiled: bool = False, logits: bool = True, **settings):
    import genfn
    from genfn.models import llama

    saved = llama._native_stack
    if not native:
        llama._native_stack = lambda *args: None
    if compiled:
        torch._dynamo.reset()
    try:
        return genfn.generate(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0, cache_implementation="static", max_cache_len=48,
                              disable_compile=not compiled, return_dict_in_generate=True, output_logits=logits,
                              **settings)
    finally:
        llama._native_stack = saved


def same(a, b) -> bool:
    return torch.equal(a.sequences, b.sequences) and (a.logits is None or torch.equal(torch.stack(a.logits),
                                                                                      torch.stack(b.logits)))


def hf_greedy(hf_model, ids, mask):
    with torch.no_grad():
        return hf_model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)


LOOKUP_PROMPT = torch.tensor([[5, 17, 3, 88, 41, 9, 5, 17, 3, 88, 41, 9, 5, 17, 3]])


def check_eager(rng, trial, formats) -> tuple[str, list[str]]:
    shape = draw_shape(rng)
    hf_model, model = tiny_pair("LlamaForCausalLM", trial, **shape)
    ids, mask = padded_prompts(rng, trial, rng.choice([1, 2, 3, 5, 9]))
    failures = []
    for fmt in formats:
        quantized = in_format(model, fmt)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            where = f"{fmt}, {threads} thread(s)"
            if fmt == "f32":
                if not torch.equal(generate(model, ids, mask).sequences, hf_greedy(hf_model, ids, mask)):
                    failures.append(f"{where}: tokens differ from transformers'")
            else:
                batched = generate(quantized, ids, mask)
                if not same(batched, generate(quantized, ids, mask, native=False)):
                    failures.append(f"{where}: the native stack differs from the layers one by one")
                # Quantized products give a row the same bits at any row count: a padded row's logits
                # are its prompt's alone (docs/guides/determinism.md), where no linear stayed float.
                logits = torch.stack(batched.logits)
                for row in range(ids.shape[0] if all_quantized(quantized) else 0):
                    prompt = ids[row:row + 1, mask[row].bool()]
                    if not torch.equal(torch.stack(generate(quantized, prompt, None).logits)[:, 0], logits[:, row]):
                        failures.append(f"{where}: row {row}'s logits in the batch differ from its prompt's alone")
                        break
            k = rng.choice([2, 3, 5, 9, 15])
            lookup = generate(quantized, LOOKUP_PROMPT, None, logits=False, prompt_lookup_num_tokens=k)
            if not torch.equal(lookup.sequences, generate(quantized, LOOKUP_PROMPT, None, logits=False).sequences):
                failures.append(f"{where}: prompt lookup (k = {k}) differs from greedy")
    return f"{shape}, {ids.shape[0]} rows", failures


def check_compiled(rng, trial, formats) -> tuple[str, list[str]]:
    shape = draw_shape(rng, group_sizes=(1, 3, 9, 12, 16))
    _, model = tiny_pair("LlamaForCausalLM", trial, **shape)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    model = model.to(dtype=dtype)
    ids, mask = padded_prompts(rng, trial, rng.choice([1, 3, 5]))
    native, layers = generate(model, ids, mask, compiled=True), generate(model, ids, mask, compiled=True, native=False)
    return (f"{shape}, {dtype}, {ids.shape[0]} rows",
            [] if same(native, layers) else ["the compiled native stack differs from the compiled layers"])


def check_family(rng, trial, formats) -> tuple[str, list[str]]:
    from genfn.batching.api import generate_batch
    import genfn

    arch = FAMILIES[trial % len(FAMILIES)]
    shape = draw_shape(rng, group_sizes=(1, 3, 9, 12))
    if arch.startswith(("Mistral", "Gemma")):
        shape["sliding_window"] = rng.choice([3, 5, 8])
    if arch.startswith("Phi3"):
        del shape["head_dim"]  # Phi-3 derives it
    if arch.startswith("Qwen3Moe"):
        shape.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                     mlp_only_layers=[])
    hf_model, model = tiny_pair(arch, trial, **shape)
    torch.set_num_threads(rng.choice([1, 2]))
    ids, mask = padded_prompts(rng, trial, rng.choice([1, 3, 5]), length=9)
    expected = hf_greedy(hf_model, ids, mask)
    failures = []
    for cache in ({"cache_implementation": "static", "max_cache_len": 40}, {}):
        out = genfn.generate(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0, disable_compile=True, **cache)
        if not torch.equal(out, expected):
            failures.append(f"{arch} {cache or 'dynamic cache'}: tokens differ from transformers'")
    prompts = [ids[row][mask[row].bool()].tolist() for row in range(ids.shape[0])]
    results = generate_batch(model, prompts, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             chunked_prefill=rng.random() < 0.5)
    if [list(r.generated_tokens) for r in results.values()] != expected[:, ids.shape[1]:].tolist():
        failures.append(f"{arch}: generate_batch differs from transformers' "
                        f"(errors: {[r.error for r in results.values()]})")
    return f"{arch} {shape}, {ids.shape[0]} rows", failures


def check_batching(rng, trial, formats) -> tuple[str, list[str]]:
    from genfn.batching.api import generate_batch
    import genfn

    shape = draw_shape(rng)
    _, model = tiny_pair("LlamaForCausalLM", trial, **shape)
    fmt = rng.choice(formats)
    quantized = in_format(model, fmt)
    if fmt != "f32" and not all_quantized(quantized):
        # A float matrix beside quantized ones: torch's GEMM moves an ulp with the row count and the
        # 8-bit activations after it turn that into other tokens; batching promises no such bits.
        fmt = f"f32 (not {fmt}: a linear would stay float)"
    else:
        model = quantized
    torch.set_num_threads(rng.choice([1, 2]))
    gen = torch.Generator().manual_seed(trial)
    prompts = [torch.randint(3, VOCAB, (rng.randint(2, 20),), generator=gen).tolist()
               for _ in range(rng.choice([1, 2, 3, 5, 9, 12]))]
    chunked = rng.random() < 0.5
    strategy = rng.choice(STRATEGIES)
    settings = dict(dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False), **strategy)
    alone_settings = {("key" if name == "seed" else name): value for name, value in settings.items()}
    # A request's returned sequences come back as results of their own (request id, then ".1", ...).
    alone = [row for p in prompts for row in genfn.generate(model, torch.tensor([p]), disable_compile=True,
                                                            **alone_settings)[:, len(p):].tolist()]
    results = generate_batch(model, prompts, chunked_prefill=chunked, **settings)
    label = f"{shape}, {fmt}, {strategy or 'greedy'}, {len(prompts)} prompts, chunked prefill {'on' if chunked else 'off'}"
    if [list(r.generated_tokens) for r in results.values()] == alone:
        return label, []
    return label, [f"generate_batch differs from generate (errors: {[r.error for r in results.values()]})"]


# What a batch's requests run: greedy, beam search (one or several sequences returned), prompt lookup,
# seeded sampling (alone, several sequences, with prompt lookup): a seeded request gives
# generate(key=seed)'s tokens.
_SAMPLED = {"do_sample": True, "temperature": 1.3, "top_k": 20, "seed": 11}
STRATEGIES = ({}, {"num_beams": 2}, {"num_beams": 3, "num_return_sequences": 2}, {"prompt_lookup_num_tokens": 4},
              _SAMPLED, dict(_SAMPLED, num_return_sequences=2), dict(_SAMPLED, prompt_lookup_num_tokens=3))

PATHS = {"eager": check_eager, "compiled": check_compiled, "families": check_family, "batching": check_batching}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--shapes", type=int, default=12, help="shapes drawn for each path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", default=",".join(("f32",) + BLOCK_FORMATS + K_FORMATS),
                        help="formats the eager and batching paths run (f32 and the block and K-quant formats)")
    args = parser.parse_args()
    paths = args.paths.split(",")
    formats = args.formats.split(",")
    unknown = [p for p in paths if p not in PATHS] + [f for f in formats if f not in ("f32",) + BLOCK_FORMATS + K_FORMATS]
    if unknown or args.shapes < 1:
        parser.error(f"unknown paths or formats {unknown}, or --shapes < 1")
    threads = torch.get_num_threads()
    failed = 0
    for path in paths:
        rng = random.Random(f"{args.seed}-{path}")
        for trial in range(args.shapes):
            try:
                label, failures = PATHS[path](rng, trial, formats)
            except Exception as err:  # an error raised on the way is a finding too, not the end of the sweep
                label, failures = "(see the error)", [f"{type(err).__name__}: {str(err)[:300]}"]
            finally:
                torch.set_num_threads(threads)
            failed += bool(failures)
            print(f"{path} shape {trial} {label}: {'ok' if not failures else 'FAILED ' + '; '.join(failures)}",
                  flush=True)
    print(f"{failed} of {len(paths) * args.shapes} shapes failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
