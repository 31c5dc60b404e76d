"""One generation request turned into OpenAI's JSON: a whole response, or a stream of chunks.

A ``Job`` is ``n`` choices per prompt, each one manager request (``runs.Run``); its outputs become
the choices' text through ``choices.ChoiceText`` (incremental, stop strings cut), with usage,
finish reasons and logprobs in the chat or the legacy completions format. A whole response
watches for the client leaving; a stream ends with ``[DONE]``, or with an SSE ``error`` event
when the generation fails or the server's drain deadline passes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from genfn.batching.requests import RequestStatus
from genfn.serve.choices import ChoiceText, chat_logprobs, completion_logprobs
from genfn.serve.errors import APIError
from genfn.serve.params import SamplingParams, manager_settings
from genfn.serve.runs import Run
from genfn.serve.sse import SSEResponse, sse_data, sse_done, sse_error
from genfn.serve.tools import ToolCallText, ToolMode, parse_tool_calls

__all__ = ["Job"]

logger = logging.getLogger(__name__)


class Job:
    """One generation request: its choices (``n`` per prompt), run and turned into OpenAI's JSON."""

    def __init__(self, service, prefix: str, kind: str, params: SamplingParams,
                 prompts: list[list[int]], limits: list[int], chat: bool, tools: ToolMode | None = None,
                 constraint: dict | None = None):
        self.service = service
        self.tools = tools
        self.params = params
        self.chat = chat
        self.kind = kind
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        n = params.n
        # Choice i*n + j is sample j of prompt i, as OpenAI numbers them.
        self.prompts = [prompt for prompt in prompts for _ in range(n)]
        self.limits = [limit for limit in limits for _ in range(n)]
        self.settings = [manager_settings(params, self.limits[c], c % n) for c in range(len(self.prompts))]
        # Beam search: one manager request per prompt gives its n choices (its n best hypotheses).
        self.sequences = n if params.num_beams > 1 else 1
        for settings in self.settings:
            if params.stop:  # the manager matches stop strings on this tokenizer's text, as the response cuts it
                settings["tokenizer"] = service.tokenizer
            if constraint:
                settings.update(constraint)
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.texts = [ChoiceText(service.tokenizer, params.stop, limit, service.eos_token_ids) for limit in self.limits]
        self.run = Run(service.manager, service.pump, service.drain, prefix)

    def _base(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.service.model_name,
                "system_fingerprint": "genfn"}

    def _usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def _logprobs(self, output, ids: list[int], start: int, text_offset: int):
        if self.params.top_logprobs is None:
            return None
        values = output.logprobs[start:start + len(ids)]
        tops = getattr(output, "top_logprobs", None)
        tops = tops[start:start + len(ids)] if tops and self.params.top_logprobs else None
        tokenizer = self.service.tokenizer
        if self.chat:
            return chat_logprobs(tokenizer, ids, values, tops)
        return completion_logprobs(tokenizer, ids, values, tops, text_offset)

    async def respond(self, request: Request):
        self.service.pump.start()
        try:
            await self.run.submit(self.prompts[::self.sequences], self.settings[::self.sequences],
                                  streaming=self.params.stream, sequences=self.sequences)
        except BaseException:
            self.run.cancel()  # also when the handler itself is cancelled while the worker adds
            raise
        if self.params.stream:
            return SSEResponse(self._stream(), on_close=self.run.cancel)
        return await self._complete(request)

    # ---- a whole response -----------------------------------------------------------------------

    async def _complete(self, request: Request) -> JSONResponse:
        finals: dict[int, object] = {}

        async def collect() -> None:
            while self.run.open:
                output = await self.run.next()
                if output.is_finished():
                    finals[self.run.index(output.request_id)] = output

        collecting = asyncio.ensure_future(collect())
        leaving = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collecting, leaving}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():  # the client left: nobody will read the answer
                return JSONResponse({}, status_code=499)
            collecting.result()
        finally:
            leaving.cancel()
            collecting.cancel()
            self.run.cancel()
        choices, completion_tokens = [], 0
        for index in range(len(self.prompts)):
            output = finals[index]
            _raise_if_failed(output, self.service.manager.is_running())
            text, _ = self.texts[index].finish(output.generated_tokens)
            completion_tokens += len(output.generated_tokens)
            logprobs = self._logprobs(output, list(output.generated_tokens), 0, 0)
            reason = self.texts[index].finish_reason
            if self.chat:
                message = {"role": "assistant", "content": text, "refusal": None}
                calls = []
                if self.tools is not None:
                    message["content"], calls = parse_tool_calls(text, self.tools)
                if calls:
                    message["tool_calls"], reason = calls, "tool_calls"
                choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})
        return JSONResponse({**self._base(self.kind), "choices": choices, "usage": self._usage(completion_tokens)})

    # ---- a stream -------------------------------------------------------------------------------

    def _chunk(self, index: int, text: str | None, logprobs, reason: str | None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            chunk = {**self._base("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
            chunk = {**self._base("text_completion"), "choices": [choice]}
        if self.params.include_usage:
            chunk["usage"] = None
        return chunk

    def _tool_chunks(self, index: int, calls: list[dict]) -> list[dict]:
        chunks = []
        for position, call in enumerate(calls):
            delta = {"tool_calls": [{"index": position, **call}]}
            chunk = {**self._base("chat.completion.chunk"),
                     "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]}
            if self.params.include_usage:
                chunk["usage"] = None
            chunks.append(chunk)
        return chunks

    async def _stream(self):
        completion_tokens = 0
        offsets = [0] * len(self.prompts)  # characters sent per choice (legacy logprobs' text_offset)
        held = [ToolCallText(self.tools) if self.tools is not None else None for _ in self.prompts]
        try:
            if self.chat:
                for index in range(len(self.prompts)):
                    yield sse_data(self._chunk(index, None, None, None, first=True))
            while self.run.open:
                output = await self.run.next()
                index = self.run.index(output.request_id)
                texts = self.texts[index]
                start = texts.consumed
                if output.is_finished():
                    _raise_if_failed(output, self.service.manager.is_running())
                    text, ids = texts.finish(output.generated_tokens)
                    completion_tokens += len(output.generated_tokens)
                else:
                    text, ids = texts.advance(output.generated_tokens)
                calls, reason = [], texts.finish_reason
                if held[index] is not None:
                    text = held[index].feed(text)
                    if output.is_finished():
                        rest, calls = held[index].finish()
                        text += rest
                        reason = "tool_calls" if calls else reason
                logprobs = self._logprobs(output, ids, start, offsets[index]) if ids else None
                offsets[index] += len(text)
                if text or logprobs is not None:
                    yield sse_data(self._chunk(index, text, logprobs, None))
                for chunk in self._tool_chunks(index, calls):
                    yield sse_data(chunk)
                if output.is_finished():
                    yield sse_data(self._chunk(index, None, None, reason))
            if self.params.include_usage:
                yield sse_data({**self._base("chat.completion.chunk" if self.chat else "text_completion"),
                                "choices": [], "usage": self._usage(completion_tokens)})
            yield sse_done()
        except APIError as exc:
            yield sse_error(exc.body())
        except Exception as exc:  # noqa: BLE001 - a stream that has started can only report in-band
            logger.error("error in a stream: %s", exc, exc_info=exc)
            yield sse_error(APIError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                     type="server_error").body())
        finally:
            self.run.cancel()


def _raise_if_failed(output, manager_running: bool = True) -> None:
    if output.status == RequestStatus.FINISHED:
        return
    if output.status == RequestStatus.CANCELLED:
        raise APIError("the request was cancelled by the server", status=503, type="server_error",
                       code="request_cancelled")
    if not manager_running:
        raise APIError(f"the engine is not running: {output.error}", status=503, type="server_error",
                       code="engine_not_running")
    raise APIError(f"generation failed: {output.error}", status=500, type="server_error", code="generation_failed")


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
