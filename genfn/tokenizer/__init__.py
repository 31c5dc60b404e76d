"""Text <-> token ids on top of the `tokenizers` library, chat templates, and GGUF vocabularies.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend that does the real work) with the
few things generation needs from transformers' tokenizers: the named special tokens, batch
encoding with left padding, chat templates rendered in a jinja2 sandbox, and an incremental
decoder for streaming. It is built from a Hugging Face directory (`tokenizer.json` +
`tokenizer_config.json`) or from the tokenizer metadata a GGUF file carries.

    tok = Tokenizer.from_pretrained("path/to/model")
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    batch = tok(["a", "longer prompt"])          # left-padded input_ids + attention_mask

Modules: ``core`` (Tokenizer, IncrementalDecoder), ``chat`` (chat template rendering),
``gguf_vocab`` (GGUF metadata -> backend). None of them imports the model loaders, which import
``core`` to attach a tokenizer to a checkpoint.
"""

from .chat import render_chat_template
from .core import IncrementalDecoder, Tokenizer
from .gguf_vocab import bytes_to_unicode

__all__ = ["Tokenizer", "IncrementalDecoder", "render_chat_template", "bytes_to_unicode"]
