"""A decoding strategy written from scratch: sampling with an annealed temperature.

The temperature starts at ``t0`` and decays by ``decay`` per generated token, so the text opens
diverse and settles. The strategy is a ``genfn.strategies.base.Strategy`` value — three pure
functions and what they can do — and ``genfn.generate(strategy=...)`` runs it through the same
driver as genfn's own strategies: eagerly or compiled (``cache_implementation="static"``), with
streamers, stopping criteria, ``max_time`` and ``output_scores``.

    python examples/custom_strategy.py "Once upon a time" --compile
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import genfn
from genfn import random as grandom
from genfn.outputs import GenerateDecoderOnlyOutput
from genfn.state import pytree_dataclass, static_field
from genfn.streamers import TextStreamer
from genfn.strategies.base import Strategy


@dataclasses.dataclass(frozen=True)
class Anneal:
    """The strategy's static settings (they select code, so they key compilation)."""

    t0: float
    decay: float
    eos_token_id: int
    pad_token_id: int
    output_scores: bool


@pytree_dataclass
class AnnealState:
    # What the driver reads: tokens, cur_len (per row), done; scores when output_scores.
    tokens: torch.Tensor  # [B, N] token buffer (prompt, then generated tokens)
    cur_len: torch.Tensor  # [B] filled columns per row
    prompt_len: torch.Tensor  # [B]
    max_length: torch.Tensor  # [B]
    positions: torch.Tensor  # [B] position of each row's newest token
    done: torch.Tensor  # [B]
    keys: torch.Tensor  # [B, 2] one key per row
    cache: object  # the model's KV cache
    scores: torch.Tensor | None  # [B, V] the latest step's tempered logits (output_scores)
    settings: Anneal = static_field()


def _pick(state: AnnealState, logits: torch.Tensor) -> AnnealState:
    s = state.settings
    generated = state.cur_len - state.prompt_len  # [B]
    temperature = s.t0 * s.decay ** generated.to(torch.float32)
    scores = logits / temperature.unsqueeze(1)
    noise = grandom.gumbel(state.keys, generated, logits.shape[-1])  # keyed: same key, same tokens
    token = torch.where(state.done, s.pad_token_id, torch.argmax(scores + noise, dim=-1))
    rows = torch.arange(state.tokens.shape[0], device=token.device)
    state.tokens.index_put_((rows, state.cur_len.clamp(max=state.tokens.shape[1] - 1)), token)  # donated buffer
    cur_len = (state.cur_len + 1).clamp(max=state.tokens.shape[1])
    done = state.done | (token == s.eos_token_id) | (cur_len >= state.max_length)
    return state.replace(cur_len=cur_len, done=done, scores=scores if s.output_scores else None)


def init(model, request, t0: float = 1.2, decay: float = 0.97) -> AnnealState:
    """Prefill the (left-padded) prompt and pick the first token. ``request`` is what generate resolved."""
    ids, mask = request.input_ids, request.attention_mask
    batch, prompt_len = ids.shape
    cache = model.init_cache(batch, request.max_cache_len, request.config.cache_implementation or "dynamic")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, cache = model.apply(ids, positions, cache, mask, logits_to_keep=1)
    tokens = torch.full((batch, request.max_cache_len), request.pad_token_id, dtype=torch.int64)
    tokens[:, :prompt_len] = ids
    keys = request.keys if request.keys is not None else grandom.as_row_keys(grandom.key(0), batch)
    eos = request.eos_token_ids[0] if request.eos_token_ids else -1
    settings = Anneal(t0, decay, eos, request.pad_token_id, request.output_scores)
    lengths = torch.full((batch,), prompt_len, dtype=torch.int64)
    state = AnnealState(tokens=tokens, cur_len=lengths, prompt_len=lengths.clone(),
                        max_length=torch.full((batch,), request.max_length, dtype=torch.int64),
                        positions=positions[:, -1], done=torch.zeros(batch, dtype=torch.bool), keys=keys,
                        cache=cache, scores=None, settings=settings)
    return _pick(state, logits[:, -1])


def step(model, state: AnnealState) -> AnnealState:
    """One token per row; pure (the driver compiles exactly this function)."""
    newest = state.tokens.gather(1, (state.cur_len - 1).unsqueeze(1))
    positions = state.positions + 1
    logits, cache = model.apply(newest, positions.unsqueeze(1), state.cache)
    return _pick(state.replace(cache=cache, positions=positions), logits[:, -1])


def collect(state: AnnealState, trace) -> None:
    if state.scores is not None:
        trace.scores.append(state.scores)


def finish(state: AnnealState, trace, request):
    sequences = state.tokens[:, : int(state.cur_len.max())].clone()
    if not request.config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=tuple(trace.scores) if trace.scores else None)


ANNEAL = Strategy(name="annealed_sampling", init=init, step=step, finish=finish, collect=collect,
                  outputs=frozenset({"scores"}))


def run(model, input_ids, max_new_tokens=32, key=None, compile=False, **kwargs):
    """``genfn.generate`` with the annealing strategy (``compile``: the static cache's compiled step)."""
    settings = dict(cache_implementation="static", max_cache_len=input_ids.shape[1] + max_new_tokens) if compile else {}
    key = grandom.key(0) if key is None else key
    return genfn.generate(model, input_ids, strategy=ANNEAL, max_new_tokens=max_new_tokens, do_sample=True, key=key,
                          **settings, **kwargs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    model = genfn.load()
    ids = torch.tensor([model.tokenizer.encode(args.prompt)])
    streamer = TextStreamer(model.tokenizer, skip_prompt=True)
    run(model, ids, args.max_new_tokens, grandom.key(args.seed), args.compile, streamer=streamer)


if __name__ == "__main__":
    main()
