"""Tool calls: the tools rendered into the prompt, and the model's reply parsed back into ``tool_calls``.

A chat template that reads ``tools`` (Qwen, Llama 3.1+, Hermes, Mistral, ...) renders them itself
(``apply_chat_template(tools=...)``). A template that ignores them (SmolLM2's) gets them in a system
message in the Hermes form, with the instruction to answer ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``. The reply is parsed in that form, or as a bare JSON object (or a list of
them) naming a declared function: those become ``tool_calls`` with ``finish_reason: "tool_calls"``;
anything else stays text. While a stream runs, ``ToolCallText`` sends text as usual, holding back
what could be the start of a tool call, and sends the calls as deltas at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from genfn.serve.stoptext import StopTextFilter

__all__ = ["ToolMode", "tool_mode", "render_prompt", "parse_tool_calls", "ToolCallText"]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


class ToolMode:
    """What a request asked of its tools: the declared functions, whether one must be called (and
    which), and whether several calls may come in one reply."""

    def __init__(self, tools: list[dict], choice: str | None, parallel: bool):
        self.tools = tools
        self.names = [tool["function"]["name"] for tool in tools]
        self.required = choice  # None ("auto"), "required", or a function name
        self.parallel = parallel


def tool_mode(request) -> ToolMode | None:
    """The tool mode of a validated ``ChatCompletionRequest``; ``None`` when no tool may be called."""
    if not request.tools or request.tool_choice == "none":
        return None
    tools = [tool.model_dump(exclude_none=True, by_alias=True) for tool in request.tools]
    choice = request.tool_choice
    required = None if choice in (None, "auto") else choice if choice == "required" else choice.function.name
    if required not in (None, "required"):  # a named choice: only that function is offered
        tools = [tool for tool in tools if tool["function"]["name"] == required]
    return ToolMode(tools, required, request.parallel_tool_calls is not False)


def _template_reads_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "tool_use" in template or any("tools" in str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def _instructions(mode: ToolMode) -> str:
    lines = ["You may call functions to answer. The functions, as JSON Schema:", "<tools>"]
    lines += [json.dumps(tool["function"], ensure_ascii=False) for tool in mode.tools]
    lines.append("</tools>")
    lines.append('To call a function, reply with <tool_call>{"name": <function-name>, "arguments": '
                 '<arguments-object>}</tool_call>' + (" (one block per call)." if mode.parallel else "."))
    if mode.required == "required":
        lines.append("You must call at least one function.")
    elif mode.required is not None:
        lines.append(f"You must call the function {mode.required}.")
    return "\n".join(lines)


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


def render_prompt(tokenizer, messages: list[dict], mode: ToolMode | None) -> list[int]:
    """The prompt's token ids: ``messages`` through the chat template, with ``mode``'s tools."""
    if mode is None:
        return list(tokenizer.apply_chat_template(_as_text(messages), add_generation_prompt=True))
    if _template_reads_tools(tokenizer):
        rendered = []
        for message in messages:
            message = dict(message)
            if "tool_calls" in message:  # templates iterate the arguments as an object
                message["tool_calls"] = [{**call, "function": {**call["function"], "arguments": _arguments_object(
                    call["function"]["arguments"])}} for call in message["tool_calls"]]
            rendered.append(message)
        return list(tokenizer.apply_chat_template(rendered, tools=mode.tools, add_generation_prompt=True))
    system = _instructions(mode)
    messages = _as_text(messages)
    if messages and messages[0]["role"] == "system":
        messages = [{"role": "system", "content": messages[0]["content"] + "\n\n" + system}] + messages[1:]
    else:
        messages = [{"role": "system", "content": system}] + messages
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _as_text(messages: list[dict]) -> list[dict]:
    """Tool calls and tool answers as plain text turns, for a template that knows only role and content."""
    plain = []
    for message in messages:
        content = message.get("content") or ""
        if message.get("tool_calls"):
            calls = [json.dumps({"name": c["function"]["name"], "arguments": _arguments_object(c["function"]
                                                                                                ["arguments"])},
                                ensure_ascii=False) for c in message["tool_calls"]]
            content = (content + "\n" if content else "") + "\n".join(f"{_OPEN}{c}{_CLOSE}" for c in calls)
            plain.append({"role": "assistant", "content": content})
        elif message["role"] == "tool":
            plain.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            plain.append({"role": message["role"], "content": content})
    return plain


def _call(item: Any, names: list[str]) -> dict | None:
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _arguments_object(arguments)
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": item["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_tool_calls(text: str, mode: ToolMode) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a reply: the text around the calls (``None`` if nothing is left)
    and the calls of declared functions. A reply without a parseable call is all content."""
    calls, content = [], text
    if _OPEN in text:
        for block in _BLOCK.findall(text):
            try:
                call = _call(json.loads(block.strip()), mode.names)
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        if calls:
            content = _BLOCK.sub("", text)
    else:
        stripped = text.strip()
        if stripped[:1] in ("{", "["):
            try:
                value = json.loads(stripped)
            except ValueError:
                value = None
            items = value if isinstance(value, list) else [value]
            found = [_call(item, mode.names) for item in items]
            if items and all(found):
                calls, content = found, ""
    if not mode.parallel:
        calls = calls[:1]
    content = content.strip() if calls else content
    return (content or None) if calls else text, calls


class ToolCallText:
    """A stream's text with tool calls held back: ``feed`` returns the text that is surely content;
    ``finish`` the rest of the content and the calls."""

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.opening = StopTextFilter([_OPEN])
        self.seen = ""  # all the text so far
        self.pending = ""  # text not yet through the ``<tool_call>`` hold-back
        self.sent = ""  # the content sent so far
        self.holding = False  # a call may have started: nothing more is sent before the end

    def feed(self, text: str) -> str:
        self.seen += text
        self.pending += text
        if self.holding:
            return ""
        if not self.sent and not self.seen.strip():
            return ""  # only whitespace yet: the reply may still be a bare JSON call
        if not self.sent and self.seen.lstrip()[:1] in ("{", "["):
            self.holding = True
            return ""
        safe, self.pending = self.opening.feed(self.pending), ""
        self.holding = self.opening.stopped
        self.sent += safe
        return safe

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = parse_tool_calls(self.seen, self.mode)
        if not calls:
            rest = self.seen[len(self.sent):]
            return rest, []
        rest = (content or "")
        rest = rest[len(self.sent):] if rest.startswith(self.sent) else ""
        return rest, calls
