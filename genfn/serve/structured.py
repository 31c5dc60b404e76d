"""Output constraints of a chat request: ``response_format`` and required tool calls -> the
constraint the engine decodes under.

``constraint_for(request, tools)`` is the one place the server asks for constrained decoding. It
returns ``None`` for free text, else the ``add_request`` settings that constrain one choice:
``{"response_format": {"type": "json_object"}}``, ``{"response_format": {"type": "json_schema",
"json_schema": {...}}}``, or for a required tool call a JSON schema of the call object
(``{"name": <one of the tools>, "arguments": <its parameters>}``). The grammar-constrained logits
processor (``genfn.structured``, the ``structured`` extra) reads that setting per request; a spec
that cannot be compiled is refused by ``add_request`` with a ValueError naming the schema path (a
400). Should the engine not declare the setting (``response_format`` among ``GenerationConfig``'s
fields), a request that needs a constraint is refused with a 400 instead of being answered
unconstrained.
"""

from __future__ import annotations

from genfn.serve.errors import APIError
from genfn.serve.tools import ToolMode

__all__ = ["constraint_for", "engine_constrains"]


def engine_constrains() -> bool:
    """Whether the engine takes a ``response_format`` setting per request."""
    from genfn.config.fields import GENERATION_CONFIG_FIELDS, GENFN_ONLY_FIELDS

    return "response_format" in GENERATION_CONFIG_FIELDS + GENFN_ONLY_FIELDS


def _tool_call_schema(mode: ToolMode) -> dict:
    variants = [{"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                                  "arguments": tool["function"].get("parameters") or {"type": "object"}},
                 "required": ["name", "arguments"], "additionalProperties": False} for tool in mode.tools]
    call = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if mode.parallel and mode.required == "required":
        return {"type": "array", "items": call, "minItems": 1}
    return call


def constraint_for(request, tools: ToolMode | None) -> dict | None:
    """The ``add_request`` settings that constrain each choice of ``request`` (a validated
    ``ChatCompletionRequest``), or ``None`` when its output is free text."""
    if tools is not None and tools.required is not None:
        spec = {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": _tool_call_schema(tools),
                                                       "strict": True}}
    elif request.response_format is not None and request.response_format.type != "text":
        spec = request.response_format.model_dump(exclude_none=True, by_alias=True)
    else:
        return None
    if not engine_constrains():
        param = "tool_choice" if tools is not None and tools.required is not None else "response_format"
        raise APIError(f"this server cannot constrain the output yet ('{param}' needs grammar-constrained "
                       f"decoding, which this genfn build lacks); ask for free text or 'tool_choice': 'auto'",
                       status=400, param=param, code="unsupported_value")
    return {"response_format": spec}
