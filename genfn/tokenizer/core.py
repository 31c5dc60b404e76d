"""The tokenizer: text <-> token ids on top of the `tokenizers` library.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend that does the real work) with the
few things generation needs from transformers' tokenizers: the named special tokens, batch
encoding with left padding, chat templates rendered in a jinja2 sandbox, and an incremental
decoder for streaming. It is built from a Hugging Face directory (`tokenizer.json` +
`tokenizer_config.json`) or from the tokenizer metadata a GGUF file carries.

    tok = Tokenizer.from_pretrained("path/to/model")
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    batch = tok(["a", "longer prompt"])          # left-padded input_ids + attention_mask
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

from .chat import render_chat_template
from .gguf_vocab import gguf_tokenizer_parts, read_gguf_metadata

__all__ = ["Tokenizer", "IncrementalDecoder"]

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A tokenizer: a `tokenizers` backend plus special tokens and a chat template.

    The tokenizer owns `backend`: it may add missing special tokens to it and set its
    post-processor. Attributes: `backend` (tokenizers.Tokenizer), `bos_token`/`eos_token`/`unk_token`/`pad_token`
    (strings or None) and their `*_id`s, `chat_template` (str or None), `vocab_size` (base
    vocabulary, without added tokens, as in transformers; `len(tok)` counts them too).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        name_or_path: str | None = None,
    ):
        self.backend = backend
        self.name_or_path = name_or_path
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        # A named special token the vocabulary lacks is added as a special token, as transformers does.
        named = (bos_token, eos_token, unk_token, pad_token)
        missing = [t for t in named if t is not None and backend.token_to_id(t) is None]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)])
        if isinstance(chat_template, Mapping):
            self.chat_templates = dict(chat_template)
            chat_template = self.chat_templates.get("default")
        else:
            self.chat_templates = {"default": chat_template} if chat_template else {}
        self.chat_template = chat_template
        # Like transformers: an explicit add_bos_token / add_eos_token (or no post-processor at all)
        # means the BOS/EOS insertion is rebuilt from these flags instead of taken from the file.
        if add_bos_token is not None or add_eos_token is not None or backend.post_processor is None:
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def from_file(
        cls,
        tokenizer_json: str | os.PathLike,
        tokenizer_config: str | os.PathLike | Mapping[str, Any] | None = None,
        special_tokens_map: str | os.PathLike | Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> Tokenizer:
        """From a `tokenizer.json` and (optionally) `tokenizer_config.json` (path or dict)."""
        tokenizer_json = os.fspath(tokenizer_json)
        try:
            backend = Backend.from_file(tokenizer_json)
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise ValueError(f"{tokenizer_json}: cannot read tokenizer ({e})") from None
        config = dict(_load_json(tokenizer_config) or {})
        for name, value in (_load_json(special_tokens_map) or {}).items():
            config.setdefault(name, value)
        template = chat_template if chat_template is not None else config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}
        return cls(
            backend,
            **{name: _token_content(config.get(name)) for name in _SPECIAL_NAMES},
            chat_template=template,
            add_bos_token=config.get("add_bos_token"),
            add_eos_token=config.get("add_eos_token"),
            name_or_path=os.path.dirname(tokenizer_json),
        )

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> Tokenizer:
        """From a Hugging Face model directory: tokenizer.json, tokenizer_config.json,
        special_tokens_map.json and, where transformers 5 puts it, chat_template.jinja."""
        directory = os.fspath(directory)
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{directory}: no tokenizer.json")

        def optional(name: str) -> str | None:
            p = os.path.join(directory, name)
            return p if os.path.isfile(p) else None

        template = None
        if jinja_path := optional("chat_template.jinja"):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        elif json_path := optional("chat_template.json"):
            template = _load_json(json_path).get("chat_template")
        return cls.from_file(path, optional("tokenizer_config.json"), optional("special_tokens_map.json"), template)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """From a GGUF file's metadata alone (its tensors are not read)."""
        path = os.fspath(path)
        return cls.from_gguf_metadata(read_gguf_metadata(path), source=path)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str | None = None) -> Tokenizer:
        """From a GGUF file's `tokenizer.*` metadata (see :func:`genfn.tokenizer.gguf_vocab.gguf_tokenizer_parts`)."""
        backend, settings = gguf_tokenizer_parts(metadata, source)
        return cls(backend, **settings, name_or_path=source)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        add_bos, add_eos = add_bos and self.bos_token is not None, add_eos and self.eos_token is not None

        def template(seq: str, type_id: int) -> str:
            parts = [f"{self.bos_token}:{type_id}"] if add_bos else []
            parts.append(f"{seq}:{type_id}")
            return " ".join(parts + ([f"{self.eos_token}:{type_id}"] if add_eos else []))

        single = template("$A", 0)
        pair = f"{single} {template('$B', 1)}"
        used = [t for t, on in ((self.bos_token, add_bos), (self.eos_token, add_eos)) if on]
        special = [(t, self.backend.token_to_id(t)) for t in dict.fromkeys(used)]
        self.backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    # ---- special tokens and vocabulary ------------------------------------------------------

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set, as the chat template sees them."""
        return {name: getattr(self, name) for name in _SPECIAL_NAMES if getattr(self, name) is not None}

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in _as_ids(ids)]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    # ---- encode / decode --------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Empty text is allowed (generate, not the tokenizer, rejects
        empty prompts)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Iterable[int] | torch.Tensor, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(_as_ids(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, sequences: Iterable[Iterable[int]] | torch.Tensor, skip_special_tokens: bool = False
    ) -> list[str]:
        if isinstance(sequences, torch.Tensor):
            sequences = sequences.tolist()
        return self.backend.decode_batch([_as_ids(s) for s in sequences], skip_special_tokens=skip_special_tokens)

    def __call__(
        self,
        texts: str | Sequence[str],
        padding_side: str = "left",
        return_tensors: str | None = "pt",
        add_special_tokens: bool = True,
    ) -> dict[str, Any]:
        """Encode a text or a batch, padded to the longest with `pad_token_id` (or, when the
        tokenizer has no pad token, `eos_token_id`, the usual practice for decoder-only models).

        Left padding is the default because generation appends on the right. Returns
        `{"input_ids", "attention_mask"}` as int64 tensors, or as lists with return_tensors=None.
        """
        if isinstance(texts, str):
            texts = [texts]
        encoded = [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
        return self.pad(encoded, padding_side=padding_side, return_tensors=return_tensors)

    def pad(
        self, sequences: Sequence[Sequence[int]], padding_side: str = "left", return_tensors: str | None = "pt"
    ) -> dict[str, Any]:
        """Pad id lists to a common length (see `__call__`)."""
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        longest = max((len(s) for s in sequences), default=0)
        pad_id = self.pad_token_id if self.pad_token_id is not None else self.eos_token_id
        if pad_id is None and any(len(s) != longest for s in sequences):
            raise ValueError("cannot pad: the tokenizer has neither a pad token nor an eos token")
        input_ids, mask = [], []
        for seq in sequences:
            seq, n = list(seq), longest - len(seq)
            if padding_side == "left":
                input_ids.append([pad_id] * n + seq)
                mask.append([0] * n + [1] * len(seq))
            else:
                input_ids.append(seq + [pad_id] * n)
                mask.append([1] * len(seq) + [0] * n)
        if return_tensors == "pt":
            return {
                "input_ids": torch.tensor(input_ids, dtype=torch.long).reshape(len(sequences), longest),
                "attention_mask": torch.tensor(mask, dtype=torch.long).reshape(len(sequences), longest),
            }
        return {"input_ids": input_ids, "attention_mask": mask}

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # ---- chat templates ---------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_tensors: str | None = None,
        return_dict: bool = False,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> Any:
        """Render a conversation (or a batch of them) with the chat template.

        Returns the text (tokenize=False), the ids (list, or a left-padded [B, L] tensor with
        return_tensors="pt"), or `{"input_ids", "attention_mask"}` with return_dict=True. The
        template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the named special
        tokens (`bos_token`, ...) and `template_kwargs`. The rendered text is encoded without
        adding special tokens: the template writes them itself.
        """
        template = self._select_template(chat_template, tools)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        batched = bool(messages) and not isinstance(messages[0], Mapping)
        conversations = list(messages) if batched else [messages]
        texts = []
        for conversation in conversations:
            if not conversation:
                raise ValueError("cannot apply a chat template to an empty conversation")
            texts.append(
                render_chat_template(
                    template,
                    conversation,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tools=tools,
                    documents=documents,
                    **{**self.special_tokens_map, **template_kwargs},
                )
            )
        if not tokenize:
            return texts if batched else texts[0]
        ids = [self.encode(t, add_special_tokens=False) for t in texts]
        if return_dict or return_tensors is not None:
            out = self.pad(ids, return_tensors=return_tensors)
            if return_dict:
                return out if (batched or return_tensors) else {k: v[0] for k, v in out.items()}
            return out["input_ids"]
        return ids if batched else ids[0]

    def _select_template(self, chat_template: str | None, tools: Any) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=...")
        return self.chat_template

    def __repr__(self) -> str:
        return (
            f"Tokenizer(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, len={len(self)}, "
            f"bos={self.bos_token!r}, eos={self.eos_token!r}, pad={self.pad_token!r})"
        )


class IncrementalDecoder:
    """Turns a stream of token ids into a stream of text pieces.

    Decoding one token at a time is wrong for byte-level BPE (a character can span tokens) and
    for sentencepiece (a token's leading space depends on what precedes it). So each `push`
    decodes a short window of recent ids twice, with and without the new ones, and emits the
    difference; text that ends in an incomplete UTF-8 sequence (decoded as U+FFFD) is held back
    until more ids complete it or `flush` gives up waiting. The concatenation of everything
    pushed and flushed equals `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: int | Iterable[int] | torch.Tensor) -> str:
        """Add ids; return the newly completed text ('' while a character is incomplete)."""
        self.ids.extend(_as_ids(ids))
        context = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) > len(context) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(context) :]
        return ""

    def flush(self) -> str:
        """Return whatever is held back, complete or not."""
        context = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(context) :]


# ---- helpers ---------------------------------------------------------------------------------


def _as_ids(ids: int | Iterable[int] | torch.Tensor) -> list[int]:
    if isinstance(ids, torch.Tensor):
        return ids.reshape(-1).tolist()
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


def _load_json(source: str | os.PathLike | Mapping[str, Any] | None) -> Any:
    if source is None or isinstance(source, Mapping):
        return source
    with open(source, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(source)}: not valid JSON ({e})") from None


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value
