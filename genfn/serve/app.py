"""The OpenAI-compatible HTTP app: a thin Starlette shell over one ``ContinuousBatchingManager``.

``create_app(manager, tokenizer, model_name=...)`` serves ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (streamed as server-sent events or not), ``/health``, ``/metrics``
(Prometheus), ``/v1/engine`` (the web page's live view) and the web page at ``/``. Each HTTP
request becomes one manager request per choice; the manager thread batches them, and the
``OutputPump`` hands their outputs back to the handlers on the event loop. The manager's life
(start, stop) belongs to whoever made it (``genfn.serve.command`` for ``genfn serve``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Mapping

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from genfn.resolve import stop_token_ids
from genfn.serve.bridge import OutputPump
from genfn.serve.errors import APIError, bad_request
from genfn.serve.params import MAX_CHOICES, SamplingParams, defaults_from_config, parse_chat, parse_completion
from genfn.serve.responses import Job
from genfn.serve.runs import Drain, shutting_down

__all__ = ["create_app", "STATIC_DIR"]

logger = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
_PLACEHOLDER_PAGE = ("<!doctype html><html><head><meta charset='utf-8'><title>genfn</title></head><body>"
                     "<h1>genfn server</h1><p>The web page is not installed; the API is at <code>/v1</code>.</p>"
                     "</body></html>")


def create_app(manager, tokenizer, *, model_name: str, generation_defaults: Mapping | None = None,
               drain_timeout: float = 30.0) -> Starlette:
    """The app over ``manager`` (started and stopped by the caller; the app takes every output the
    manager delivers, so nothing else should read its results). ``generation_defaults``: sampling defaults
    (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``max_tokens``);
    ``None`` takes those the model's generation config sets. ``drain_timeout``: at shutdown, how
    long requests in flight may still run before they end with an error."""
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"`model_name` must be a non-empty string, got {model_name!r}")
    service = _Service(manager, tokenizer, model_name, generation_defaults, drain_timeout)
    api = [
        Route("/models", service.models, methods=["GET"]),
        Route("/models/{model:path}", service.model, methods=["GET"]),
        Route("/engine", service.engine, methods=["GET"]),
        Route("/completions", service.completions, methods=["POST"]),
        Route("/chat/completions", service.chat_completions, methods=["POST"]),
    ]
    # /v1 is a router of its own, so that under it an unknown path is a 404 and a wrong method a
    # 405 (both as error JSON) instead of falling through to the static files at /.
    routes = [
        Route("/health", service.health, methods=["GET"]),
        Route("/metrics", service.metrics, methods=["GET"]),
        Mount("/v1", routes=api),
    ]
    if os.path.isfile(os.path.join(STATIC_DIR, "index.html")):
        routes.append(Mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="static"))
    else:
        routes.append(Route("/", lambda request: HTMLResponse(_PLACEHOLDER_PAGE), methods=["GET"]))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.pump.start()
        try:
            yield
        finally:
            service.pump.close()

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _server_error})
    app.state.genfn = service
    return app


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    error = APIError(exc.detail or "error", status=exc.status_code,
                     code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(error.body(), status_code=exc.status_code)


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("error serving %s: %s", request.url.path, exc, exc_info=exc)
    error = APIError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error")
    return JSONResponse(error.body(), status_code=500)


class _Service:
    def __init__(self, manager, tokenizer, model_name, generation_defaults, drain_timeout):
        self.manager = manager
        self.tokenizer = tokenizer
        self.model_name = model_name
        model = manager.model
        config = getattr(manager, "generation_config", None) or getattr(model, "generation_config", None)
        self.defaults = dict(defaults_from_config(config) if generation_defaults is None else generation_defaults)
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

    async def health(self, request: Request) -> JSONResponse:
        if self.drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not self.manager.is_running():
            return JSONResponse({"status": "stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "genfn"}

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> JSONResponse:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    def _metrics(self):
        metrics = getattr(self.manager, "metrics", None)
        if metrics is None:
            raise APIError("this batching manager reports no metrics", status=501, type="server_error")
        return metrics()

    async def metrics(self, request: Request) -> PlainTextResponse:
        from genfn.serve.prometheus import render

        return PlainTextResponse(render(self._metrics(), self.model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def engine(self, request: Request) -> JSONResponse:
        m = self._metrics()
        return JSONResponse({"model": self.model_name, "tokens_per_second": m.tokens_per_second,
                             "running": m.running, "waiting": m.waiting, "kv_blocks_used": m.kv_blocks_used,
                             "kv_blocks_total": m.kv_blocks_total, "requests_finished": m.requests_finished})

    # ---- checks shared by both generation endpoints ---------------------------------------------

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

    async def _body(self, request: Request) -> dict:
        if self.drain.draining:
            raise shutting_down()
        if not self.manager.is_running():  # a request queued now would wait for a start() that may never come
            raise APIError("the engine is not running (the batching manager was not started or has stopped)",
                           status=503, type="server_error", code="engine_not_running")
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(f"We could not parse the JSON body of your request: {exc}", status=400,
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError("The request body must be a JSON object", status=400, code="invalid_json")
        return body

    # ---- generation -----------------------------------------------------------------------------

    async def completions(self, request: Request):
        body = await self._body(request)
        params, prompt = parse_completion(body, self.defaults, self.vocab_size)
        self._check_model(params.model)
        prompts = self._completion_prompts(prompt)
        if len(prompts) * params.n > MAX_CHOICES:
            raise bad_request("n", f"{len(prompts)} prompts x n={params.n} asks for more than {MAX_CHOICES} choices")
        limits = [self._max_new_tokens(params, len(p), "prompt", "max_tokens") for p in prompts]
        job = Job(self, "cmpl", "text_completion", params, prompts, limits, chat=False)
        return await job.respond(request)

    async def chat_completions(self, request: Request):
        body = await self._body(request)
        params, messages = parse_chat(body, self.defaults, self.vocab_size)
        self._check_model(params.model)
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template refuses a conversation by raising anything
            raise bad_request("messages", f"the chat template refused these messages: {exc}") from None
        tokens_param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        limits = [self._max_new_tokens(params, len(prompt), "messages", tokens_param)]
        job = Job(self, "chatcmpl", "chat.completion", params, [list(prompt)], limits, chat=True)
        return await job.respond(request)

    def _completion_prompts(self, prompt) -> list[list[int]]:
        """``prompt``: a string, a list of strings, a list of token ids or a list of such lists."""
        def ids(value) -> list[int]:
            if not value or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                raise bad_request("prompt", "a token-id prompt must be a non-empty list of integers",
                                  code="invalid_type")
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
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [text(p) for p in prompt]
            if all(isinstance(p, list) for p in prompt):
                return [ids(p) for p in prompt]
            return [ids(prompt)]
        raise bad_request("prompt", "'prompt' must be a string, a list of strings, a list of token ids or a list "
                                    "of token-id lists", code="invalid_type")
