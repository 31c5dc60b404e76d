"""The custom-strategy example is a Strategy written from scratch that runs through generate():
eagerly and compiled, with a streamer, a stopping criterion and output_scores."""

import importlib.util
import pathlib
import sys

import torch

import genfn
from conftest import tiny_pair

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "custom_strategy.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("custom_strategy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


class _Collect:
    def __init__(self):
        self.parts, self.ended = [], 0

    def put(self, value):
        self.parts.append(torch.as_tensor(value).reshape(-1).tolist())

    def end(self):
        self.ended += 1


def test_custom_strategy_is_reproducible_and_respects_eos():
    example = _load_example()
    _, model = tiny_pair(eos_token_id=5)
    ids = torch.tensor([[7, 8, 9], [10, 11, 12]])
    a = example.run(model, ids, max_new_tokens=12, key=genfn.random.key(3))
    b = example.run(model, ids, max_new_tokens=12, key=genfn.random.key(3))
    c = example.run(model, ids, max_new_tokens=12, key=genfn.random.key(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape[1] <= 15 and torch.equal(a[:, :3], ids)
    pad = model.generation_config.pad_token_id
    for row in a[:, 3:]:
        hits = (row == 5).nonzero()
        if len(hits):  # after its EOS a row holds padding, as transformers' outputs do
            assert (row[int(hits[0]) + 1:] == pad).all()


def test_custom_strategy_runs_compiled_with_streamer_criteria_and_scores():
    example = _load_example()
    _, model = tiny_pair(eos_token_id=96)
    ids = torch.tensor([[7, 8, 9, 10]])
    eager = example.run(model, ids, max_new_tokens=10, key=genfn.random.key(1), return_dict_in_generate=True,
                        output_scores=True)
    streamer = _Collect()
    seen = []

    def stop_after_eight(input_ids, scores):
        seen.append(input_ids.shape[1])
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + 8)

    compiled = example.run(model, ids, max_new_tokens=10, key=genfn.random.key(1), compile=True,
                           return_dict_in_generate=True, output_scores=True, streamer=streamer,
                           stopping_criteria=[stop_after_eight])
    # The criterion stopped the compiled run after 8 new tokens; up to there it equals the eager run.
    assert compiled.sequences.shape[1] == ids.shape[1] + 8 == seen[-1]
    assert torch.equal(compiled.sequences, eager.sequences[:, : ids.shape[1] + 8])
    assert len(compiled.scores) == 8 and len(eager.scores) == 10
    for a, b in zip(compiled.scores, eager.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # The streamer saw the prompt, then each new token, and was ended once.
    assert streamer.parts[0] == ids[0].tolist()
    assert sum(streamer.parts[1:], []) == compiled.sequences[0, ids.shape[1]:].tolist()
    assert streamer.ended == 1
