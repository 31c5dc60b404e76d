"""The API's request and response bodies as pydantic v2 models, in OpenAI's shapes.

FastAPI validates each request body against these models and publishes them in ``/openapi.json``;
``errors.validation_error`` turns a failed validation into OpenAI's 400 naming the field. Types
are strict where OpenAI's are (``true`` is not a number, ``1.5`` not an integer). A field OpenAI
documents but genfn does not use (``metadata``, ``store``, ``service_tier``, ``user``, ...) is
accepted and ignored; a field nobody documents is refused (``unknown_parameter``). Settings that
span fields (``top_logprobs`` needs ``logprobs``, a named ``tool_choice`` needs that tool) are
checked here too, so every refusal of a body happens before the engine sees it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

__all__ = ["MAX_CHOICES", "MAX_STOP_STRINGS", "MAX_TOP_LOGPROBS", "MAX_LEGACY_LOGPROBS", "ChatCompletionRequest",
           "CompletionRequest", "Message", "Tool", "FunctionDefinition", "NamedToolChoice", "ResponseFormat",
           "JSONSchemaFormat", "StreamOptions", "ErrorResponse", "ModelCard", "ModelList", "ChatCompletion",
           "Completion"]

MAX_CHOICES = 64
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_LEGACY_LOGPROBS = 5
MAX_PROMPT_LOOKUP_TOKENS = 64  # drafts per step; more only lengthens the forward of a rejected block
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def refuse(param: str, message: str, code: str = "invalid_value") -> PydanticCustomError:
    """A validation error naming ``param`` (relative to the model that raises it) and OpenAI's ``code``."""
    # pydantic fills ``{name}`` from the context; the message goes in as a value, so braces in it stay.
    return PydanticCustomError(code, "{message}", {"param": param, "message": message})


def _strict(kind, **limits):
    return Annotated[kind, Field(strict=True, **limits)]


StrictInt = _strict(int)
StrictBool = _strict(bool)
StrictStr = _strict(str)
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- pieces ---------------------------------------------------------------------------------------


class StreamOptions(_Body):
    include_usage: StrictBool | None = None


class FunctionDefinition(_Body):
    name: StrictStr = Field(description="the function's name: letters, digits, '_' and '-', at most 64")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON Schema of the arguments")
    strict: StrictBool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _FUNCTION_NAME.match(name):
            raise refuse("", f"a function name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        return name


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Body):
    name: StrictStr


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: FunctionName


class JSONSchemaFormat(_Body):
    name: StrictStr = Field(default="response", max_length=64)
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Body):
    """``text`` (free text), ``json_object`` (any JSON object) or ``json_schema`` (this schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise refuse("json_schema", "'response_format' of type 'json_schema' needs a 'json_schema' object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise refuse("json_schema", f"'json_schema' goes with the type 'json_schema', not {self.type!r}")
        return self


class ToolCallFunction(_Body):
    name: StrictStr
    arguments: StrictStr = Field(description="the arguments as a JSON text")


class ToolCall(_Body):
    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    refusal: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise refuse("", "message content parts must be {'type': 'text', 'text': str}; this server "
                                     "reads text only", code="invalid_type")
        elif content is not None and not isinstance(content, str):
            raise refuse("", "message content must be a string or a list of text parts", code="invalid_type")
        return content

    @model_validator(mode="after")
    def _role_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise refuse("tool_calls", "only an assistant message has 'tool_calls'")
        if self.role == "tool" and self.tool_call_id is None:
            raise refuse("tool_call_id", "a tool message needs the 'tool_call_id' it answers",
                         code="missing_required_parameter")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise refuse("content", "a message needs 'content' (an assistant message may have 'tool_calls' "
                                    "instead)", code="missing_required_parameter")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


# ---- the two generation requests ----------------------------------------------------------------------


class _Generation(_Body):
    """The fields both endpoints take. ``None`` (or left out): the server's default."""

    model: StrictStr | None = None
    max_tokens: _strict(int, ge=1) | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    n: _strict(int, ge=1, le=MAX_CHOICES) | None = None
    stop: StrictStr | list[StrictStr] | None = Field(default=None, description=f"at most {MAX_STOP_STRINGS}")
    seed: StrictInt | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Number] | None = Field(default=None, description="token id (as a string) -> bias in "
                                                                           "[-100, 100]")
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: StrictStr | None = Field(default=None, description="accepted and ignored")
    # vLLM's extensions, which the web page and many clients send.
    top_k: _strict(int, ge=-1) | None = Field(default=None, description="0 or -1: no top-k filter")
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    # Bounded so that it fits the engine's float32 tables (the engine fails on 1e308 with a RuntimeError).
    repetition_penalty: Annotated[Number, Field(gt=0, le=1e4)] | None = None
    # Beam search (OpenAI clients send them in extra_body): the n best of num_beams hypotheses.
    num_beams: _strict(int, ge=1, le=MAX_CHOICES) | None = None
    length_penalty: Annotated[Number, Field(ge=-10, le=10)] | None = None
    early_stopping: StrictBool | Literal["never"] | None = None
    # genfn's: prompt-lookup speculation (drafts copied from the request's own text; same output, fewer steps).
    prompt_lookup_num_tokens: _strict(int, ge=1, le=MAX_PROMPT_LOOKUP_TOKENS) | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        if stop is None:
            return None
        items = [stop] if isinstance(stop, str) else stop
        if len(items) > MAX_STOP_STRINGS:
            raise refuse("", f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(items)}")
        if any(not s for s in items):
            raise refuse("", "'stop' strings must not be empty")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias):
        for key, amount in (bias or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise refuse("", f"'logit_bias' keys must be token ids, got {key!r}")
            if not -100 <= amount <= 100:
                raise refuse("", f"'logit_bias' values must be between -100 and 100, got {amount} for token {key}")
        return bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise refuse("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if (self.num_beams or 1) > 1 and (self.n or 1) > self.num_beams:
            raise refuse("n", f"'n' ({self.n}) must be at most 'num_beams' ({self.num_beams}): the choices are the "
                              f"best n beam hypotheses")
        if (self.num_beams or 1) == 1 and (self.length_penalty is not None or self.early_stopping is not None):
            raise refuse("num_beams", "'length_penalty' and 'early_stopping' need 'num_beams' > 1")
        return self


class CompletionRequest(_Generation):
    """``POST /v1/completions``."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="a text, a list of texts, a list of token ids or a list of such lists")
    logprobs: _strict(int, ge=0, le=MAX_LEGACY_LOGPROBS) | None = None
    echo: StrictBool | None = Field(default=None, description="only false")
    suffix: StrictStr | None = Field(default=None, description="only null")
    best_of: _strict(int, ge=1) | None = Field(default=None, description="only equal to n")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt):
        if prompt is None:
            raise refuse("", "'prompt' is required", code="missing_required_parameter")
        if isinstance(prompt, list) and not prompt:
            raise refuse("", "'prompt' must not be empty")
        return prompt

    @model_validator(mode="after")
    def _unsupported(self):
        if self.echo:
            raise refuse("echo", "'echo' is not supported by this server")
        if self.suffix is not None:
            raise refuse("suffix", "'suffix' is not supported by this server")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise refuse("best_of", "'best_of' other than 'n' is not supported by this server")
        return self


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: _strict(int, ge=1) | None = None
    logprobs: StrictBool | None = None
    top_logprobs: _strict(int, ge=0, le=MAX_TOP_LOGPROBS) | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # Accepted and ignored: genfn keeps nothing and has one tier.
    metadata: dict[str, StrictStr] | None = Field(default=None, description="accepted and ignored")
    store: StrictBool | None = Field(default=None, description="accepted and ignored: nothing is stored")
    service_tier: StrictStr | None = Field(default=None, description="accepted and ignored")
    reasoning_effort: StrictStr | None = Field(default=None, description="accepted and ignored")

    @model_validator(mode="after")
    def _cross_fields(self):
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise refuse("max_completion_tokens", "give 'max_completion_tokens' or 'max_tokens', not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise refuse("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise refuse("tools", f"tool names must be unique, got {names}")
        choice = self.tool_choice
        if choice == "required" and not names:
            raise refuse("tool_choice", "'tool_choice' 'required' needs 'tools'")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise refuse("tool_choice", f"'tool_choice' names the function {choice.function.name!r}, which is not "
                                        f"among the tools ({', '.join(names) or 'none given'})")
        if self.tools and self.response_format is not None and self.response_format.type != "text":
            uses_tools = choice == "required" or isinstance(choice, NamedToolChoice)
            if uses_tools:
                raise refuse("response_format", "a JSON 'response_format' and a required tool call cannot both "
                                                "constrain one reply")
        return self

    @property
    def completion_limit(self) -> tuple[int | None, str]:
        """The completion's token limit and the field that set it (named in a context-length error)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


# ---- responses (documented in /openapi.json; the handlers write the same shapes) -----------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    sampling_defaults: dict[str, Any] = Field(default_factory=dict,
                                              description="genfn: the settings a request that leaves them out gets")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage
