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

    linear_names = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                    "up_proj.weight", "down_proj.weight")
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
