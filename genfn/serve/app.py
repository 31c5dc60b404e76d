"""The OpenAI-compatible HTTP app: a thin FastAPI shell over one ``ContinuousBatchingManager``.

``create_app(manager, tokenizer, model_name=...)`` serves ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (streamed as server-sent events or not), ``/health``, ``/metrics``
(Prometheus), ``/v1/engine`` (the web page's live view), the web page at ``/``, and the API's
schema at ``/openapi.json`` (browsable at ``/docs``). Request bodies are the pydantic models of
``schemas``; every refusal is OpenAI's error JSON. Each HTTP request becomes one manager request
per choice; the manager thread batches them, and the ``OutputPump`` hands their outputs back to
the handlers on the event loop. The manager's life (start, stop) belongs to whoever made it
(``genfn.serve.command`` for ``genfn serve``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping

from fastapi import APIRouter, Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse

from genfn.resolve import stop_token_ids
from genfn.serve.bridge import OutputPump
from genfn.serve.defaults import sampling_defaults
from genfn.serve.errors import APIError, bad_request, validation_error
from genfn.serve.limits import BodyLimit
from genfn.serve.params import MAX_CHOICES, SamplingParams, chat_params, completion_params, plain_messages
from genfn.serve.responses import Job
from genfn.serve.runs import Drain, shutting_down
from genfn.serve.schemas import (ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ErrorResponse,
                                 ModelCard, ModelList)
from genfn.serve.structured import constraint_for
from genfn.serve.tools import render_prompt, tool_mode

__all__ = ["create_app", "STATIC_DIR", "MAX_BODY_BYTES"]

logger = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
MAX_BODY_BYTES = 8 * 1024 * 1024
_PLACEHOLDER_PAGE = ("<!doctype html><html><head><meta charset='utf-8'><title>genfn</title></head><body>"
                     "<h1>genfn server</h1><p>The web page is not installed; the API is at <code>/v1</code>.</p>"
                     "</body></html>")
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 404, 413, 500, 503)}


def create_app(manager, tokenizer, *, model_name: str, generation_defaults: Mapping | None = None,
               sampling: str | Mapping = "auto", drain_timeout: float = 30.0,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app over ``manager`` (started and stopped by the caller; the app takes every output the
    manager delivers, so nothing else should read its results). The sampling defaults a request
    gets for what it leaves out: ``generation_defaults`` exactly when given, else ``sampling``
    (``"auto"``: the model's generation config, else temperature 0.7, top-p 0.95, top-k 50;
    ``"none"``; or ``{"temperature": ..., ...}`` over ``auto``; see ``genfn.serve.defaults``).
    ``drain_timeout``: at shutdown, how long requests in flight may still run before they end with
    an error. ``max_body_bytes``: a larger request body is refused with a 413."""
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"`model_name` must be a non-empty string, got {model_name!r}")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"`max_body_bytes` must be a positive integer, got {max_body_bytes!r}")
    service = _Service(manager, tokenizer, model_name, generation_defaults, sampling, drain_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.pump.start()
        try:
            yield
        finally:
            service.pump.close()

    app = FastAPI(title="genfn", summary="OpenAI-compatible text generation over genfn's continuous batching",
                  version=_version(), lifespan=lifespan,
                  exception_handlers={APIError: _api_error, HTTPException: _http_error,
                                      RequestValidationError: _validation_error, Exception: _server_error})
    ready = Depends(service.ready)
    api = APIRouter(prefix="/v1", responses=_ERRORS)
    api.add_api_route("/models", service.models, methods=["GET"], response_model=ModelList)
    api.add_api_route("/models/{model:path}", service.model, methods=["GET"], response_model=ModelCard)
    api.add_api_route("/engine", service.engine, methods=["GET"], include_in_schema=False)
    api.add_api_route("/completions", service.completions, methods=["POST"], dependencies=[ready],
                      responses={200: {"model": Completion, "content": {"text/event-stream": {}}}})
    api.add_api_route("/chat/completions", service.chat_completions, methods=["POST"], dependencies=[ready],
                      responses={200: {"model": ChatCompletion, "content": {"text/event-stream": {}}}})
    app.include_router(api)
    app.add_api_route("/health", service.health, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", service.metrics, methods=["GET"], include_in_schema=False)
    _add_page(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.state.genfn = service
    return app


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("genfn")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def _add_page(app: FastAPI) -> None:
    """The web page: ``/`` and its files by name (no mount at ``/``, so that an unknown ``/v1`` path
    stays a 404 and a wrong method a 405)."""
    files = sorted(os.listdir(STATIC_DIR)) if os.path.isdir(STATIC_DIR) else []

    async def index():
        if "index.html" in files:
            return FileResponse(os.path.join(STATIC_DIR, "index.html"))
        return HTMLResponse(_PLACEHOLDER_PAGE)

    async def asset(name: str):
        if name not in files:
            raise HTTPException(404, f"no such file: /{name}")
        return FileResponse(os.path.join(STATIC_DIR, name))

    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.add_api_route("/index.html", index, methods=["GET"], include_in_schema=False)
    app.add_api_route("/{name}", asset, methods=["GET"], include_in_schema=False)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    error = validation_error(exc.errors())
    return JSONResponse(error.body(), status_code=error.status)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed", 400: "invalid_json"}.get(exc.status_code)
    message = exc.detail or "error"
    if exc.status_code == 400 and "parsing the body" in str(message):
        message = "We could not parse the JSON body of your request (it must be UTF-8 JSON)"
    error = APIError(message, status=exc.status_code, code=code)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("error serving %s: %s", request.url.path, exc, exc_info=exc)
    error = APIError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error")
    return JSONResponse(error.body(), status_code=500)


class _Service:
    def __init__(self, manager, tokenizer, model_name, generation_defaults, sampling, drain_timeout):
        self.manager = manager
        self.tokenizer = tokenizer
        self.model_name = model_name
        model = manager.model
        config = getattr(manager, "generation_config", None) or getattr(model, "generation_config", None)
        self.defaults = dict(sampling_defaults(config, sampling) if generation_defaults is None
                             else generation_defaults)
        self.vocab_size = model.vocab_size
        self.eos_token_ids = set(stop_token_ids(config, tokenizer))
        self.pump = OutputPump(manager)
        self.drain = Drain()
        self.drain_timeout = drain_timeout
        self.created = int(time.time())

    def begin_drain(self) -> None:
        """Shutdown began: requests in flight get ``drain_timeout`` seconds more, new ones are refused."""
        self.drain.begin(self.drain_timeout)

    # ---- small endpoints ----------------------------------------------------------------------

    async def health(self) -> JSONResponse:
        if self.drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not self.manager.is_running():
            return JSONResponse({"status": "stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "genfn",
                "sampling_defaults": {k: v for k, v in self.defaults.items() if v is not None}}

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, model: str) -> JSONResponse:
        self._check_model(model)
        return JSONResponse(self._model_card())

    def _metrics(self):
        metrics = getattr(self.manager, "metrics", None)
        if metrics is None:
            raise APIError("this batching manager reports no metrics", status=501, type="server_error")
        return metrics()

    async def metrics(self) -> PlainTextResponse:
        from genfn.serve.prometheus import CONTENT_TYPE, render

        return PlainTextResponse(render(self._metrics(), self.model_name), media_type=CONTENT_TYPE)

    async def engine(self) -> JSONResponse:
        m = self._metrics()
        return JSONResponse({"model": self.model_name, "tokens_per_second": m.tokens_per_second,
                             "running": m.running, "waiting": m.waiting, "kv_blocks_used": m.kv_blocks_used,
                             "kv_blocks_total": m.kv_blocks_total, "requests_finished": m.requests_finished})

    # ---- checks shared by both generation endpoints ---------------------------------------------

    async def ready(self) -> None:
        """Runs before a generation request's body is validated: a server that is shutting down,
        or whose engine does not run, answers 503 whatever the body."""
        if self.drain.draining:
            raise shutting_down()
        if not self.manager.is_running():  # a request queued now would wait for a start() that may never come
            raise APIError("the engine is not running (the batching manager was not started or has stopped)",
                           status=503, type="server_error", code="engine_not_running")

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                           status=404, param="model", code="model_not_found")

    def _max_new_tokens(self, params: SamplingParams, prompt_len: int, prompt_param: str,
                        tokens_param: str) -> int:
        limit = self.manager.max_request_tokens
        if prompt_len >= limit:
            raise APIError(f"This model's maximum context length is {limit} tokens; the prompt has {prompt_len} "
                           f"tokens. Shorten the prompt.", status=400, param=prompt_param,
                           code="context_length_exceeded")
        room = limit - prompt_len
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, "
                           f"{params.max_tokens} in the completion). Reduce '{tokens_param}' to at most {room}.",
                           status=400, param=tokens_param, code="context_length_exceeded")
        return params.max_tokens

    # ---- generation -----------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        params = completion_params(body, self.defaults, self.vocab_size)
        self._check_model(params.model)
        prompts = self._completion_prompts(body.prompt)
        if len(prompts) * params.n > MAX_CHOICES:
            raise bad_request("n", f"{len(prompts)} prompts x n={params.n} asks for more than {MAX_CHOICES} choices")
        limits = [self._max_new_tokens(params, len(p), "prompt", "max_tokens") for p in prompts]
        job = Job(self, "cmpl", "text_completion", params, prompts, limits, chat=False)
        return await job.respond(request)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        params = chat_params(body, self.defaults, self.vocab_size)
        self._check_model(params.model)
        tools = tool_mode(body)
        constraint = constraint_for(body, tools)
        try:
            prompt = render_prompt(self.tokenizer, plain_messages(body), tools)
        except Exception as exc:  # noqa: BLE001 - a template refuses a conversation by raising anything
            raise bad_request("messages", f"the chat template refused these messages: {exc}") from None
        limits = [self._max_new_tokens(params, len(prompt), "messages", body.completion_limit[1])]
        job = Job(self, "chatcmpl", "chat.completion", params, [list(prompt)], limits, chat=True, tools=tools,
                  constraint=constraint)
        return await job.respond(request)

    def _completion_prompts(self, prompt) -> list[list[int]]:
        """``prompt`` (validated): a string, a list of strings, a list of token ids or a list of such lists."""
        def ids(value) -> list[int]:
            if not value:
                raise bad_request("prompt", "a token-id prompt must be a non-empty list of integers")
            bad = [t for t in value if not 0 <= t < self.vocab_size]
            if bad:
                raise bad_request("prompt", f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
            return list(value)

        def text(value: str) -> list[int]:
            encoded = self.tokenizer.encode(value)
            if not encoded:
                raise bad_request("prompt", "the prompt is empty")
            return encoded

        if isinstance(prompt, str):
            return [text(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [text(p) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return [ids(p) for p in prompt]
        return [ids(prompt)]

