"""The rank side of tests/test_tensor_parallel*.py: each spawned rank joins a gloo group, runs
every check of a list on its shard and on the whole model, and sends the results to the test.

Lives outside the test files so that ``torch.multiprocessing``'s spawned children can import it.
"""

from __future__ import annotations

import traceback

import torch

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 12, 13, 12, 13]]  # the second left-padded
MASK = [[1] * 7, [0, 0, 0, 1, 1, 1, 1]]
REPEATING = [[20, 21, 22, 23, 20, 21, 22, 23, 20, 21]]  # prompt lookup finds drafts in it


def tiny_state(arch: str, seed: int = 0, **overrides):
    from conftest import tiny_hf_model

    hf_model, config = tiny_hf_model(arch, seed, **overrides)
    return config, dict(hf_model.state_dict())


def quantized_state(state: dict, fmt: str) -> dict:
    """The linears of ``state`` as ``RowBlocks`` in ``fmt`` (as a GGUF file would hold them)."""
    from genfn.quant.blocks import quantize

    linear_names = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "qkv_proj.weight", "o_proj.weight",
                    "gate_proj.weight", "up_proj.weight", "gate_up_proj.weight", "down_proj.weight")
    return {k: quantize(v.float(), fmt) if k.endswith(linear_names) else v for k, v in state.items()}


def _pair(config, state, shard, quantized: bool):
    from genfn.models.model import from_hf_state_dict
    from genfn.models.quantized import quantize_params

    whole = from_hf_state_dict(config, state)
    mine = from_hf_state_dict(config, state, tensor_shard=shard)
    if quantized:  # RowBlocks -> the kernel's tiles, the same way genfn.load(quantize="gguf") does
        whole.params = quantize_params(whole.params, "gguf")
        mine.params = quantize_params(mine.params, "gguf")
    return whole, mine


def _tokens(out) -> list:
    return (out if isinstance(out, torch.Tensor) else out.sequences).tolist()


def model_checks(config, state, shard, quantized: bool = False, compiled: bool = False) -> dict:
    """Tokens of the whole model and of this rank's shard for each mode (and the largest logit gap)."""
    import genfn

    whole, mine = _pair(config, state, shard, quantized)
    ids, mask = torch.tensor(PROMPTS), torch.tensor(MASK)
    extra = {"cache_implementation": "static"} if compiled else {}
    runs = {
        "greedy": dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, **extra),
        "sampled": dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=True, temperature=1.3,
                        key=7, **extra),
    }
    if not compiled:
        runs["beam"] = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False)
        runs["prompt_lookup"] = dict(input_ids=torch.tensor(REPEATING), max_new_tokens=10, do_sample=False,
                                     prompt_lookup_num_tokens=3)
    out = {}
    for name, kwargs in runs.items():
        # compiled: the shard's compiled step against the whole model's eager one (one compile each)
        reference = {k: v for k, v in kwargs.items() if k != "cache_implementation"}
        out[name] = (_tokens(genfn.generate(whole, **reference)), _tokens(genfn.generate(mine, **kwargs)))
    out["logit_gap"] = (whole(ids, mask).logits - mine(ids, mask).logits).abs().max().item()
    if not compiled:  # every decode step's logits too (the native decode layer against the rank's pieces)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                      return_dict_in_generate=True, output_logits=True)
        one, split = genfn.generate(whole, **kwargs), genfn.generate(mine, **kwargs)
        out["step_gap"] = max(float((a - b).abs().max()) for a, b in zip(one.logits, split.logits))
    out["kv_heads"] = mine.spec.num_kv_heads
    return out


def run_rank(rank: int, world: int, port: int, checks: list, results) -> None:
    """Join the group, run ``checks`` (``(name, callable path, kwargs)``), send ``(rank, name,
    result or error text)`` for each, then ``(rank, None, None)``."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from genfn.distributed import init_tensor_parallel, shutdown

    shard = init_tensor_parallel(world, rank=rank, init_method=f"tcp://127.0.0.1:{port}", timeout=120,
                                 set_threads=False)
    try:
        for name, check, kwargs in checks:
            try:
                results.put((rank, name, globals()[check](shard=shard, **kwargs)))
            except Exception as err:  # reported to the test, which fails with it
                results.put((rank, name, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
            dist.barrier()
    finally:
        results.put((rank, None, None))
        shutdown()


def arch_check(arch: str, shard, quantize: str | None = None, compiled: bool = False, **overrides) -> dict:
    config, state = tiny_state(arch, **overrides)
    if quantize is not None:
        state = quantized_state(state, quantize)
    return model_checks(config, state, shard, quantized=quantize is not None, compiled=compiled)


def family_check(arch: str, shard, quantize: str | None = None, batch: bool = True, **overrides) -> dict:
    """A family's tiny model (its linears as ``quantize`` blocks, or float), whole and as this
    rank's shard: greedy tokens, the prefill's and every decode step's logits, and (``batch``) a
    continuous batch (8 greedy requests, chunked prefill, preemption) through each model's manager
    (rank 0 leads the shard's, rank 1 follows)."""
    import genfn
    from genfn.config.batching import ContinuousBatchingConfig

    config, state = tiny_state(arch, **overrides)
    if quantize is not None:
        state = quantized_state(state, quantize)
    whole, mine = _pair(config, state, shard, quantized=quantize is not None)
    ids, mask = torch.tensor(PROMPTS), torch.tensor(MASK)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                  return_dict_in_generate=True, output_logits=True)
    one, split = genfn.generate(whole, **kwargs), genfn.generate(mine, **kwargs)
    out = {"greedy": (_tokens(one), _tokens(split)),
           "logit_gap": (whole(ids, mask).logits - mine(ids, mask).logits).abs().max().item(),
           "step_gap": max(float((a - b).abs().max()) for a, b in zip(one.logits, split.logits)),
           "kv_heads": mine.spec.num_kv_heads}
    if batch:
        cb = ContinuousBatchingConfig(page_size=4, num_blocks=24, max_batch_tokens=16, max_requests_per_batch=4)
        requests = _batch_requests()[:8]
        out["batch"] = (_run_manager(whole, cb, requests), _run_manager(mine, cb, requests))
    return out


def kv_error_check(shard) -> str:
    """The error a model with fewer KV heads than ranks raises (or a note that it raised none)."""
    from genfn.models.model import from_hf_state_dict

    config, state = tiny_state("LlamaForCausalLM", num_key_value_heads=1)
    try:
        from_hf_state_dict(config, state, tensor_shard=shard)
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


def smollm2_check(shard) -> dict:
    import genfn
    from conftest import smollm2_path

    whole = genfn.load(smollm2_path(), quantize="gguf")
    mine = genfn.load(smollm2_path(), quantize="gguf", tensor_shard=shard)
    ids = torch.tensor([whole.tokenizer.encode("The capital of France is")])
    kwargs = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_logits=True)
    one, split = genfn.generate(whole, ids, **kwargs), genfn.generate(mine, ids, **kwargs)
    return {"greedy": (_tokens(one), _tokens(split)),
            "logit_gaps": [float((a.float() - b.float()).abs().max()) for a, b in zip(one.logits, split.logits)],
            "kv_heads": mine.spec.num_kv_heads}


def _batch_requests() -> list:
    """A mixed batch: prompts of 1 to 50 tokens (some sharing a 13-token system prefix), greedy
    rows, a sampled row, a beam-search row and a prompt-lookup row."""
    import random

    rng = random.Random(3)
    system = [rng.randrange(3, 97) for _ in range(13)]
    requests = []
    for i in range(12):
        prompt = [rng.randrange(3, 97) for _ in range(rng.randint(1, 50))]
        requests.append((system + prompt[:20] if i % 3 == 1 else prompt, rng.randint(1, 12), {"do_sample": False}))
    requests.append((REPEATING[0] * 2, 10, {"do_sample": False, "prompt_lookup_num_tokens": 3}))
    requests.append((PROMPTS[0], 8, {"do_sample": True, "temperature": 1.3, "seed": 7}))
    requests.append((PROMPTS[0][2:], 6, {"do_sample": False, "num_beams": 2}))
    # guidance's unconditional branch is a row of the packed batch: it runs on every rank's shard
    requests.append((PROMPTS[0][1:], 5, {"do_sample": False, "guidance_scale": 1.5}))
    return requests


def _run_manager(model, cb, requests, wait: float = 300.0) -> dict:
    """Every request through ``ContinuousBatchingManager(model)`` (the leader's or a follower's on a
    shard), the same calls on every rank: ids, rank 0's tokens, the stats and what ran."""
    import time

    from genfn.batching import ContinuousBatchingManager

    manager = ContinuousBatchingManager(model, None, cb, prefill_tokens_while_decoding="uncapped")
    manager.start()
    ids = [manager.add_request(prompt, max_new_tokens=limit, **settings) for prompt, limit, settings in requests]
    outputs, deadline = {}, time.monotonic() + wait
    while ids[0] is not None and len(outputs) < len(ids) and time.monotonic() < deadline:
        out = manager.get_result(timeout=1.0)
        if out is not None and out.is_finished():
            outputs[out.request_id] = out
    engine = manager.engine if manager.engine is not None else getattr(manager, "follower_engine", None)
    compiled = engine is not None and engine.compiled
    manager.stop(block=True, timeout=wait)
    return {"ids": ids, "compiled": compiled, "tokens": [outputs[i].generated_tokens if i in outputs else None for i in ids],
            "errors": [outputs[i].error for i in ids if i in outputs and outputs[i].error],
            "preempted": manager.stats["preempted"], "steps": manager.stats["steps"],
            "role": manager.tensor_parallel_role, "running": manager.is_running()}


def batching_check(shard) -> dict:
    """Continuous batching of ``_batch_requests`` on the whole model (one process) and on this
    rank's shard (rank 0 leads, the others follow), with chunked prefill (16 tokens a forward)
    and preemption (24 blocks of 4 tokens for 6 rows at a time)."""
    from genfn.config.batching import ContinuousBatchingConfig
    from genfn.models.model import from_hf_state_dict

    config, state = tiny_state("LlamaForCausalLM")
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=24, max_batch_tokens=16, max_requests_per_batch=6)
    requests = _batch_requests()
    whole, mine = from_hf_state_dict(config, state), from_hf_state_dict(config, state, tensor_shard=shard)
    out = {"whole": _run_manager(whole, cb, requests), "sharded": _run_manager(mine, cb, requests)}
    # generate_batch (warm-up, start, stop, destroy) on every rank: rank 0's outputs, {} elsewhere
    prompts = [prompt for prompt, _, _ in requests[:4]]
    for name, model in (("batch_whole", whole), ("batch_sharded", mine)):
        results = model.generate_batch(prompts, max_new_tokens=5, do_sample=False, continuous_batching_config=cb)
        out[name] = [r.generated_tokens for r in results.values()]
    return out


def early_exit_error_check(shard) -> str:
    """What rank 0's manager says to an assistant_early_exit request on a shard (the others add nothing)."""
    from genfn.batching import ContinuousBatchingManager
    from genfn.models.model import from_hf_state_dict

    config, state = tiny_state("LlamaForCausalLM")
    manager = ContinuousBatchingManager(from_hf_state_dict(config, state, tensor_shard=shard))
    try:
        manager.add_request(PROMPTS[0], max_new_tokens=3, assistant_early_exit=1)
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


def max_time_check(shard) -> dict:
    """``max_time`` decided by rank 0's clock: each rank passes a different budget, so a rank that
    used its own would stop at another step than the others (and leave them in a collective)."""
    import genfn
    from genfn.models.model import from_hf_state_dict

    config, state = tiny_state("LlamaForCausalLM")
    mine = from_hf_state_dict(config, state, tensor_shard=shard)
    ids, mask = torch.tensor(PROMPTS), torch.tensor(MASK)
    rank0 = shard.rank == 0
    plenty = genfn.generate(mine, input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                            max_time=1e6 if rank0 else 0.0)  # rank 0 has time: every rank runs 10 steps
    none = genfn.generate(mine, input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                          max_time=0.0 if rank0 else 1e6)  # rank 0 has none: every rank stops after the first token
    free = genfn.generate(mine, input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    return {"plenty": _tokens(plenty), "none": _tokens(none), "free": _tokens(free), "prompt_len": ids.shape[1]}


# ---- mixtures of experts (tests/test_tensor_parallel_moe.py) -------------------------------


def moe_gguf_check(shard, path: str) -> dict:
    """A GGUF file's quantized experts, each rank reading only its slice of every expert (blocks
    kept): greedy tokens and every step's logits of the whole model and of this rank's shard."""
    import genfn
    from genfn.kernels import moe_quant

    whole = genfn.load(path, quantize="gguf")
    mine = genfn.load(path, quantize="gguf", tensor_shard=shard)
    ids, mask = torch.tensor(PROMPTS), torch.tensor(MASK)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
                  output_logits=True, disable_compile=True)
    one, split = genfn.generate(whole, ids, **kwargs), genfn.generate(mine, ids, **kwargs)
    layer = mine.params["layers"][0]
    single = dict(kwargs, attention_mask=None)  # one row: each decode step runs the native kernel where it can
    alone, alone_split = genfn.generate(whole, ids[:1], **single), genfn.generate(mine, ids[:1], **single)
    return {"greedy": (_tokens(one), _tokens(split)), "alone": (_tokens(alone), _tokens(alone_split)),
            "step_gap": max(float((a - b).abs().max()) for a, b in zip(one.logits, split.logits)),
            "alone_gap": max(float((a - b).abs().max()) for a, b in zip(alone.logits, alone_split.logits)),
            "format": layer["experts_down"].format, "expert_rows": layer["experts_gate_up"].shape[1],
            "native": moe_quant.takes(torch.zeros(1, mine.spec.hidden_size), layer["experts_gate_up"],
                                      layer["experts_down"])}


def expert_tokens_check(shard, path: str, prompts: int = 16, steps: int = 24) -> dict:
    """A deep model's quantized experts (the MoE sums added in another order than one process's):
    greedy tokens of random prompts, whole and sharded; for each prompt whose tokens differ, the
    step of the first difference and the whole model's top-2 logit margin there; the largest gap."""
    import genfn

    whole = genfn.load(path, quantize="gguf")
    mine = genfn.load(path, quantize="gguf", tensor_shard=shard)
    vocab = whole.spec.vocab_size
    rng = torch.Generator().manual_seed(0)
    kwargs = dict(max_new_tokens=steps, do_sample=False, return_dict_in_generate=True, output_logits=True,
                  disable_compile=True)
    out = {"prompts": prompts, "differ": [], "gaps": []}
    for _ in range(prompts):
        ids = torch.randint(3, vocab, (1, int(torch.randint(4, 40, (1,), generator=rng))), generator=rng)
        one, split = genfn.generate(whole, ids, **kwargs), genfn.generate(mine, ids, **kwargs)
        new_one, new_split = one.sequences[0, ids.shape[1]:], split.sequences[0, ids.shape[1]:]
        same = int((new_one == new_split).cumprod(0).sum())  # steps before the first difference
        out["gaps"].append(max(float((a - b).abs().max()) for a, b in zip(one.logits[:same + 1], split.logits)))
        if same < steps:
            top = one.logits[same][0].topk(2).values
            out["differ"].append((same, float(top[0] - top[1])))
    return out


def compiled_batching_check(shard, arch: str = "LlamaForCausalLM", **overrides) -> dict:
    """Continuous batching with the packed forward compiled (``default_compile_level=1``) on the
    whole model and on this rank's shard: greedy requests only, rank 0's tokens."""
    from genfn.config.batching import ContinuousBatchingConfig
    from genfn.models.model import from_hf_state_dict

    config, state = tiny_state(arch, **overrides)
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=32, max_batch_tokens=8, max_requests_per_batch=4,
                                  default_compile_level=1)
    requests = [(prompt, limit, {"do_sample": False}) for prompt, limit, _ in _batch_requests()[:6]]
    whole, mine = from_hf_state_dict(config, state), from_hf_state_dict(config, state, tensor_shard=shard)
    return {"whole": _run_manager(whole, cb, requests, wait=1500),
            "sharded": _run_manager(mine, cb, requests, wait=1500)}


# ---- GPT-OSS (tests/test_tensor_parallel_gpt_oss.py) ----------------------------------------

# Two layers (one sliding, one full), 64 expert rows: two ranks hold 32 each, a whole MXFP4 block of down's inputs.
GPT_OSS = dict(num_hidden_layers=2, intermediate_size=64)


def gpt_oss_check(shard, gguf_path: str) -> dict:
    """A tiny GPT-OSS (sinks, q/k/v/o and expert biases, a biased router), whole and as this rank's
    shard: ``model_checks``' tokens and logit gaps, a continuous batch of greedy requests through
    each model's manager, and the model's MXFP4 GGUF file read slice by slice (greedy tokens)."""
    import genfn
    from genfn.config.batching import ContinuousBatchingConfig
    from test_gpt_oss import tiny_gpt_oss

    hf = tiny_gpt_oss(**GPT_OSS)
    config, state = {**hf.config.to_dict(), "architectures": ["GptOssForCausalLM"]}, dict(hf.state_dict())
    out = model_checks(config, state, shard)
    whole, mine = _pair(config, state, shard, quantized=False)
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=24, max_batch_tokens=16, max_requests_per_batch=4)
    requests = _batch_requests()[:8]
    out["batch"] = (_run_manager(whole, cb, requests), _run_manager(mine, cb, requests))
    layer = mine.params["layers"][0]
    # what the bias checks rest on: o's and the experts' down biases are not zero
    out["bias_sums"] = (float(layer["bo"].abs().sum()), float(layer["experts_down_bias"].abs().sum()))
    ids, mask = torch.tensor(PROMPTS), torch.tensor(MASK)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    whole_file, mine_file = genfn.load(gguf_path), genfn.load(gguf_path, tensor_shard=shard)
    out["gguf"] = tuple(_tokens(genfn.generate(model, ids, **kwargs)) for model in (whole_file, mine_file))
    out["gguf_expert_rows"] = mine_file.params["layers"][0]["experts_gate_up"].shape[1]
    # quantize="q8_0": the linears and every expert as Q8_0 blocks, each rank quantizing its slice
    from genfn.models.quantized import quantize_params

    whole.params, mine.params = quantize_params(whole.params, "q8_0"), quantize_params(mine.params, "q8_0")
    out["q8_0"] = tuple(_tokens(genfn.generate(model, ids, **kwargs)) for model in (whole, mine))
    out["q8_0_experts"] = type(mine.params["layers"][0]["experts_down"]).__name__
    return out


def gpt_oss_uneven_check(shard) -> dict:
    """``model_checks`` on 3 key/value groups of 2 heads over 2 ranks: 1 group on rank 0, 2 on rank 1."""
    from test_gpt_oss import tiny_gpt_oss

    hf = tiny_gpt_oss(**GPT_OSS, num_attention_heads=6, num_key_value_heads=3)
    config = {**hf.config.to_dict(), "architectures": ["GptOssForCausalLM"]}
    return model_checks(config, dict(hf.state_dict()), shard)


def gpt_oss_compiled_check(shard) -> dict:
    """``model_checks`` with the shard's decode step compiled (greedy and sampled tokens)."""
    from test_gpt_oss import tiny_gpt_oss

    hf = tiny_gpt_oss(**GPT_OSS)
    config = {**hf.config.to_dict(), "architectures": ["GptOssForCausalLM"]}
    return model_checks(config, dict(hf.state_dict()), shard, compiled=True)


def local_all_reduce_check(shard) -> dict:
    """The shared-memory all-reduce against gloo's on the same inputs (float32, bfloat16, shapes of
    one value to a full slot, one over it), several calls in a row (the slots are reused)."""
    import torch.distributed as dist

    from genfn import local_all_reduce

    reducer = local_all_reduce.for_group(shard.group_name)
    out = {"opened": reducer is not None, "equal": []}
    generator = torch.Generator().manual_seed(100 + shard.rank)
    for dtype in (torch.float32, torch.bfloat16):
        full = local_all_reduce.DEFAULT_CAPACITY // torch.finfo(dtype).bits * 8
        for size in (1, 576, 49152, 3, full, full + 1):
            x = torch.randn(size, generator=generator).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            fits = reducer is not None and reducer.fits(x)
            got = reducer.all_reduce(x.clone()) if fits else None
            out["equal"].append((str(dtype), size, fits, got is not None and torch.equal(got, expected)))
    return out


def dead_peer_check(shard) -> str:
    """Rank 1 leaves without reducing; rank 0's reduction names it instead of waiting forever."""
    import os
    import time

    from genfn import local_all_reduce

    reducer = local_all_reduce.for_group(shard.group_name)
    if shard.rank == 1:
        os._exit(0)
    start = time.monotonic()
    try:
        reducer.all_reduce(torch.ones(8))
    except RuntimeError as err:
        return f"{time.monotonic() - start:.1f} s: {err}"
    return "no error"


def three_rank_sum_check(shard) -> list:
    """Three ranks: each rank's shared-memory sum of the same inputs (every rank should hold the same
    bits, the sum in rank order) beside gloo's."""
    import torch.distributed as dist

    from genfn import local_all_reduce

    reducer = local_all_reduce.for_group(shard.group_name)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(7 + shard.rank))
    expected = x.clone()
    dist.all_reduce(expected)
    parts = [torch.randn(1000, generator=torch.Generator().manual_seed(7 + r)) for r in range(shard.world_size)]
    in_rank_order = parts[0] + parts[1]
    for part in parts[2:]:
        in_rank_order += part
    got = reducer.all_reduce(x.clone())
    return [got.tolist(), torch.equal(got, in_rank_order), float((got - expected).abs().max())]
