"""Streamers: the transformers-tokenizer path prints exactly what transformers' streamers print,
genfn's tokenizer path prints whole characters, streams end once on any exit, consumers never
wait forever, and bad values are refused."""

from __future__ import annotations

import asyncio
import copy
import functools
import io
import queue
import threading

import pytest
import torch

import genfn
from genfn.streamers import (
    AsyncTextIteratorStreamer,
    BaseStreamer,
    GenerationError,
    TextIteratorStreamer,
    TextStreamer,
    close_stream,
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.\nA second line, with commas; and more!",
    "Tokyo is 東京 and Beijing is 北京. Café crème, naïve résumé.",
    "Emoji 🙂 and symbols: 3.14 x 2 = 6.28 (approx).\n\nDone",
]
WAIT = 30  # seconds any test waits on another thread at most


@functools.lru_cache(maxsize=1)
def backend():
    """A byte-level BPE trained here with the tokenizers library, with two special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 4, trainer=trainer)
    return tok


def hf_tokenizer():
    import transformers

    return transformers.PreTrainedTokenizerFast(tokenizer_object=copy.deepcopy(backend()), bos_token="<s>",
                                                eos_token="</s>")


def genfn_tokenizer():
    from genfn.tokenizer import Tokenizer

    return Tokenizer(copy.deepcopy(backend()), bos_token="<s>", eos_token="</s>")


def puts_of(text: str, tokenizer, chunk: int = 1, special: bool = False):
    """What generate would put: the prompt [1, P], then the new tokens [1] (or [1, k]) at a time."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if special:
        ids = ids + [tokenizer.convert_tokens_to_ids("</s>")]
    prompt, rest = ids[:5], ids[5:]
    pieces = [torch.tensor([prompt])]
    pieces += [torch.tensor(rest[i:i + chunk]) if chunk == 1 else torch.tensor([rest[i:i + chunk]])
               for i in range(0, len(rest), chunk)]
    return ids, pieces


class Recorder:
    """Collects what a streamer finalizes (its on_finalized_text calls)."""

    def __init__(self, streamer):
        self.pieces = []
        streamer.on_finalized_text = lambda text, stream_end=False: self.pieces.append((text, stream_end))


# ---- the transformers-tokenizer path -----------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("options", [dict(), dict(skip_prompt=True), dict(skip_prompt=True, skip_special_tokens=True)])
def test_text_streamer_with_a_transformers_tokenizer_prints_what_transformers_prints(text, options):
    import transformers

    tok = hf_tokenizer()
    ours, theirs = TextStreamer(tok, **options), transformers.TextStreamer(tok, **options)
    got, expected = Recorder(ours), Recorder(theirs)
    _, pieces = puts_of(text, tok, special=True)
    for piece in pieces:
        ours.put(piece)
        theirs.put(piece)
    ours.end()
    theirs.end()
    assert got.pieces == expected.pieces
    assert len([p for p in got.pieces if p[0]]) > 3, "the text should arrive in several pieces"


def test_iterator_streamer_with_a_transformers_tokenizer_in_another_thread():
    tok = hf_tokenizer()
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=WAIT)
    ids, pieces = puts_of(TEXTS[1], tok, chunk=3)

    def produce():
        for piece in pieces:
            streamer.put(piece)
        streamer.end()

    thread = threading.Thread(target=produce)
    thread.start()
    received = list(streamer)
    thread.join(timeout=WAIT)
    assert not thread.is_alive()
    assert "".join(received) == tok.decode(ids[5:]) and len(received) > 2


# ---- genfn's tokenizer path --------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2])
def test_text_streamer_with_genfn_tokenizer_prints_whole_characters(text, chunk):
    tok = genfn_tokenizer()
    out = io.StringIO()
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True, stream=out)
    got = Recorder(streamer)
    ids, pieces = puts_of(text, tok, chunk=chunk, special=True)
    for piece in pieces:
        streamer.put(piece)
    streamer.end()
    texts = [t for t, _ in got.pieces]
    assert "".join(texts) == tok.decode(ids[5:], skip_special_tokens=True)
    assert not any("\ufffd" in t for t in texts), "a character split across tokens must print whole"
    assert got.pieces[-1][1] and sum(end for _, end in got.pieces) == 1


def test_genfn_tokenizer_refuses_decode_options_it_does_not_have():
    with pytest.raises(TypeError, match="clean_up_tokenization_spaces"):
        TextStreamer(genfn_tokenizer(), clean_up_tokenization_spaces=True)
    with pytest.raises(TypeError, match="tokenizer"):
        TextStreamer(object())


# ---- ending, failing, timeouts -----------------------------------------------------------------

def test_end_is_idempotent():
    out = io.StringIO()
    streamer = TextStreamer(hf_tokenizer(), stream=out)
    streamer.put(torch.tensor([[5, 6, 7]]))
    streamer.end()
    printed = out.getvalue()
    streamer.end()
    assert out.getvalue() == printed and printed.endswith("\n")
    # A new put starts a new stream, which ends (once) again.
    streamer.put(torch.tensor([[8]]))
    streamer.end()
    streamer.end()
    assert out.getvalue() == printed + hf_tokenizer().decode([8]) + "\n"

    iterator = TextIteratorStreamer(hf_tokenizer(), timeout=WAIT)
    iterator.end()  # generation failed before the prompt was put: the consumer is still released
    iterator.end()
    assert list(iterator) == []
    with pytest.raises(queue.Empty):
        TextIteratorStreamer(hf_tokenizer(), timeout=0.05).__next__()


def test_fail_raises_in_the_consumer_thread_instead_of_hanging():
    streamer = TextIteratorStreamer(hf_tokenizer(), timeout=WAIT)
    outcome = {}

    def consume():
        try:
            outcome["texts"] = list(streamer)
        except GenerationError as err:
            outcome["error"] = err

    thread = threading.Thread(target=consume)
    thread.start()
    streamer.put(torch.tensor([[5, 6]]))
    cause = RuntimeError("the step blew up")
    close_stream(streamer, cause)
    streamer.end()  # after a failure, ending again does nothing
    thread.join(timeout=WAIT)
    assert not thread.is_alive()
    assert "texts" not in outcome and outcome["error"].__cause__ is cause
    assert "RuntimeError: the step blew up" in str(outcome["error"])
    assert streamer.text_queue.empty()


def test_close_stream_ends_a_transformers_streamer():
    import transformers

    streamer = transformers.TextIteratorStreamer(hf_tokenizer(), timeout=WAIT)
    streamer.put(torch.tensor([[5, 6]]))
    close_stream(streamer, ValueError("bad"))  # it has no fail(): end() releases the consumer
    assert "".join(streamer) == hf_tokenizer().decode([5, 6])  # would raise queue.Empty if not ended
    close_stream(None)

    class Plain(BaseStreamer):
        ended = 0

        def end(self):
            self.ended += 1

    plain = Plain()
    close_stream(plain, ValueError("x"))
    close_stream(plain)
    assert plain.ended == 2


@pytest.mark.parametrize("value,error,match", [
    ([1, 2], TypeError, "torch.Tensor"),
    (torch.tensor([1.0, 2.0]), TypeError, "float32"),
    (torch.tensor([True]), TypeError, "bool"),
    (torch.zeros(1, 1, 2, dtype=torch.long), TypeError, "shape"),
    (torch.zeros(2, 3, dtype=torch.long), ValueError, "batch size 1"),
])
def test_put_refuses_bad_values(value, error, match):
    for streamer in (TextStreamer(hf_tokenizer(), stream=io.StringIO()),
                     TextIteratorStreamer(genfn_tokenizer())):
        with pytest.raises(error, match=match):
            streamer.put(value)


def test_put_accepts_zero_new_tokens():
    out = io.StringIO()
    streamer = TextStreamer(genfn_tokenizer(), stream=out)
    streamer.put(torch.tensor([[5, 6]]))
    streamer.put(torch.zeros(1, 0, dtype=torch.long))  # a step that appended nothing to the row
    streamer.put(torch.tensor([7]))
    streamer.end()
    assert out.getvalue() == genfn_tokenizer().decode([5, 6, 7]) + "\n"


# ---- asyncio -----------------------------------------------------------------------------------

def test_async_streamer_yields_the_text_and_times_out():
    tok = hf_tokenizer()
    ids, pieces = puts_of(TEXTS[0], tok)

    async def main():
        streamer = AsyncTextIteratorStreamer(tok, skip_prompt=True, timeout=WAIT)

        def produce():
            for piece in pieces:
                streamer.put(piece)
            streamer.end()
            streamer.end()

        producer = asyncio.get_running_loop().run_in_executor(None, produce)
        received = [text async for text in streamer]
        await asyncio.wait_for(producer, WAIT)

        silent = AsyncTextIteratorStreamer(tok, timeout=0.05)
        with pytest.raises(asyncio.TimeoutError):
            async for _ in silent:
                pass

        failing = AsyncTextIteratorStreamer(tok, timeout=WAIT)
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, lambda: (failing.put(torch.tensor([[5]])), failing.fail(KeyError("k"))))
        with pytest.raises(GenerationError, match="KeyError"):
            async for _ in failing:
                pass
        return received

    received = asyncio.run(asyncio.wait_for(main(), 4 * WAIT))
    assert "".join(received) == tok.decode(ids[5:]) and len(received) > 3


def test_async_streamer_needs_a_running_loop():
    with pytest.raises(RuntimeError, match="coroutine"):
        AsyncTextIteratorStreamer(hf_tokenizer())


# ---- through generate --------------------------------------------------------------------------

@pytest.mark.parametrize("make_tokenizer", [hf_tokenizer, genfn_tokenizer])
def test_generate_streams_to_an_iterating_thread(make_tokenizer):
    from conftest import tiny_pair

    tok = make_tokenizer()
    _, model = tiny_pair(vocab_size=backend().get_vocab_size(), bos_token_id=0, eos_token_id=1, pad_token_id=1)
    ids = torch.tensor([tok.encode("The quick brown fox", add_special_tokens=False)])
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=WAIT)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=genfn.generate(
        model, ids, max_new_tokens=12, eos_token_id=None, streamer=streamer)))
    thread.start()
    received = list(streamer)
    thread.join(timeout=WAIT)
    assert not thread.is_alive()
    new = result["out"][0, ids.shape[1]:].tolist()
    assert "".join(received) == tok.decode(new)
