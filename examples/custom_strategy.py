"""A decoding strategy written from scratch: sampling with an annealed temperature.

The temperature starts at ``t0`` and decays by ``decay`` per generated token, so the text opens
diverse and settles. It is three pure functions of the same shape as genfn's own strategies,
and it runs through the same driver, eagerly or compiled.

    python examples/custom_strategy.py "Once upon a time" --compile
"""

from __future__ import annotations

import argparse

import torch

import genfn
from genfn import driver
from genfn import random as grandom
from genfn.state import pytree_dataclass, static_field


@pytree_dataclass
class AnnealState:
    tokens: torch.Tensor  # [B, N]
    cur_len: torch.Tensor  # []
    prompt_len: torch.Tensor  # []
    positions: torch.Tensor  # [B]
    done: torch.Tensor  # [B]
    keys: torch.Tensor  # [B, 2]
    cache: object
    t0: float = static_field()
    decay: float = static_field()
    eos_token_id: int = static_field()


def _pick(state: AnnealState, logits: torch.Tensor) -> AnnealState:
    generated = state.cur_len - state.prompt_len
    temperature = state.t0 * state.decay ** generated.to(torch.float32)
    noise = grandom.gumbel(state.keys, generated.expand(state.tokens.shape[0]), logits.shape[-1])
    token = torch.argmax(logits / temperature + noise, dim=-1)
    token = torch.where(state.done, state.eos_token_id, token)
    state.tokens.index_copy_(1, state.cur_len.reshape(1), token[:, None])  # the buffer is donated
    return state.replace(cur_len=state.cur_len + 1, done=state.done | (token == state.eos_token_id))


def init(model, input_ids, max_cache_len, key, t0=1.2, decay=0.97) -> AnnealState:
    batch, prompt_len = input_ids.shape
    cache = model.init_cache(batch, max_cache_len)
    positions = torch.arange(prompt_len).expand(batch, prompt_len)
    logits, cache = model.apply(input_ids, positions, cache, logits_to_keep=1)
    tokens = torch.zeros(batch, max_cache_len, dtype=torch.int64)
    tokens[:, :prompt_len] = input_ids
    eos = model.generation_config.eos_token_id
    state = AnnealState(tokens=tokens, cur_len=torch.tensor(prompt_len), prompt_len=torch.tensor(prompt_len),
                        positions=positions[:, -1], done=torch.zeros(batch, dtype=torch.bool),
                        keys=grandom.as_row_keys(key, batch), cache=cache, t0=t0, decay=decay,
                        eos_token_id=int(eos[0] if isinstance(eos, list) else eos))
    return _pick(state, logits[:, -1])


def step(model, state: AnnealState) -> AnnealState:
    newest = state.tokens.gather(1, (state.cur_len - 1).reshape(1, 1).expand(state.tokens.shape[0], 1))
    positions = state.positions + 1
    logits, cache = model.apply(newest, positions[:, None], state.cache)
    return _pick(state.replace(cache=cache, positions=positions), logits[:, -1])


def finish(state: AnnealState) -> torch.Tensor:
    return state.tokens[:, : int(state.cur_len)]


def run(model, input_ids, max_new_tokens=32, key=None, compile=False) -> torch.Tensor:
    key = grandom.key(0) if key is None else key
    state = init(model, input_ids, input_ids.shape[1] + max_new_tokens, key)
    advance = (driver.compiled_step(step, model, state, {"fullgraph": True}) if compile
               else driver.eager_step(step, model))
    state = driver.run_loop(advance, state, num_steps=max_new_tokens - 1, all_done=lambda s: bool(s.done.all()))
    return finish(state)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    model = genfn.load()
    ids = torch.tensor([model.tokenizer.encode(args.prompt)])
    out = run(model, ids, args.max_new_tokens, grandom.key(args.seed), args.compile)
    print(model.tokenizer.decode(out[0].tolist(), skip_special_tokens=True))


if __name__ == "__main__":
    main()
