"""Reproducible sampling with keys: a row's tokens depend on its key, never on its batch.

``genfn.random.split(key, 4)`` makes one key per prompt. Each prompt is sampled twice: alone
(a batch of one, with its own key) and together with the three others (a left-padded batch of
four, given the four keys as a ``[4, 2]`` tensor). The noise a sampling step adds to a row is a
function of (the row's key, the step, the vocabulary index) only, so both runs give every row
the same tokens; a different key gives different ones.

    python examples/sampling_keys.py --seed 7 --max-new-tokens 24
"""

from __future__ import annotations

import argparse

import torch

import genfn

PROMPTS = ["The sea at night is", "The capital of France is", "Once upon a time,",
           "Three things to pack for a hike:"]
SAMPLING = dict(do_sample=True, temperature=0.9, top_p=0.95)


def _new_tokens(row: torch.Tensor, prompt_width: int, pad_token_id: int, eos_ids: set) -> list[int]:
    """The tokens a row generated, up to and including its EOS (a batch pads rows that ended early)."""
    tokens = []
    for token in row[prompt_width:].tolist():
        tokens.append(token)
        if token in eos_ids:
            break
    while tokens and tokens[-1] == pad_token_id and pad_token_id not in eos_ids:
        tokens.pop()
    return tokens


def sample_alone_and_batched(model, prompts, seed: int, max_new_tokens: int):
    """(tokens of each prompt sampled alone, tokens of each row sampled in one batch), same keys."""
    tok = model.tokenizer
    keys = genfn.random.split(genfn.random.key(seed), len(prompts))  # [B, 2]: one key per prompt
    config = model.generation_config
    eos = config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
    pad = config.pad_token_id if config.pad_token_id is not None else next(iter(eos_ids))
    alone = []
    for i, prompt in enumerate(prompts):
        ids = tok([prompt])["input_ids"]
        out = genfn.generate(model, ids, key=keys[i:i + 1], max_new_tokens=max_new_tokens, **SAMPLING)
        alone.append(_new_tokens(out[0], ids.shape[1], pad, eos_ids))
    batch = tok(prompts, padding_side="left")
    out = genfn.generate(model, batch["input_ids"], attention_mask=batch["attention_mask"], key=keys,
                         max_new_tokens=max_new_tokens, **SAMPLING)
    batched = [_new_tokens(row, batch["input_ids"].shape[1], pad, eos_ids) for row in out]
    return alone, batched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory or .gguf file (default: SmolLM2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    model = genfn.load(args.model)
    alone, batched = sample_alone_and_batched(model, PROMPTS, args.seed, args.max_new_tokens)
    other, _ = sample_alone_and_batched(model, PROMPTS[:1], args.seed + 1, args.max_new_tokens)
    for prompt, a, b in zip(PROMPTS, alone, batched):
        print(f"{prompt!r}\n  alone:   {model.tokenizer.decode(a, skip_special_tokens=True)!r}\n"
              f"  batched: {'same tokens' if a == b else model.tokenizer.decode(b, skip_special_tokens=True)!r}")
    print(f"another seed for the first prompt: {model.tokenizer.decode(other[0], skip_special_tokens=True)!r}")
    if alone != batched:
        raise SystemExit("a row's tokens changed with its batch")
    print("every row sampled the same tokens alone and in a batch of", len(PROMPTS))


if __name__ == "__main__":
    main()
