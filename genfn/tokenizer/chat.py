"""Chat templates: jinja2 templates from model files, rendered in a sandbox the way transformers does.

Chat templates come from model files, so they run in jinja2's immutable sandbox, with the same
environment as transformers (trim_blocks, lstrip_blocks, loop controls and the ``raise_exception`` /
``strftime_now`` helpers) so that they render identically.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["render_chat_template"]


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}...{% endgeneration %}` blocks (used to mark the
    assistant's tokens for training masks); genfn only renders their body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """Chat templates come from model files, so they run in jinja2's immutable sandbox, with the
    same environment as transformers (trim_blocks, lstrip_blocks, loop controls and the
    `raise_exception` / `strftime_now` helpers) so that they render identically."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> str:
    """Render one conversation. Keys whose value is None are dropped from the messages (APIs send
    `content=None`, templates handle a missing key better). With continue_final_message the text
    stops right after the last message's content, so the model continues it."""
    messages = [_plain({k: v for k, v in dict(m).items() if v is not None}) for m in messages]
    if continue_final_message:
        content = messages[-1].get("content")
        if not isinstance(content, str):
            raise ValueError("continue_final_message needs the final message's content to be a string")
        messages[-1]["content"] = content + _CONTINUE_TAG
    try:
        text = _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from None
    if continue_final_message:
        cut = text.rfind(_CONTINUE_TAG.strip())
        if cut < 0:
            raise ValueError("continue_final_message: the template dropped the final message")
        text = text[:cut] if text[cut:].startswith(_CONTINUE_TAG) else text[:cut].rstrip()
    return text


def _plain(value: Any) -> Any:
    """A deep copy built from JSON-like types, so a template never touches callers' objects."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
