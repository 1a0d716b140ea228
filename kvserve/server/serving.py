"""What the completion and chat handlers share: server state, body parsing, opening engine streams
(with errors mapped to HTTP statuses), SSE framing, and client-disconnect handling."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from kvserve.engine.async_engine import (AsyncEngine, EngineDeadError, EngineInternalError, EngineOverloadedError,
                                         RequestAbortedError, RequestStream, RequestTimeoutError)
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError, from_validation_error
from kvserve.server.metrics import ServerMetrics
from kvserve.server.limits import check_sampling
from kvserve.server.lora_registry import LoRARegistry
from kvserve.server.prefix_report import RecentPrompts, build_report
from kvserve.server.prompts import Prompt, TextLimit
from kvserve.server.tool_parsers import TaggedJsonParser

logger = logging.getLogger("kvserve.server")

M = TypeVar("M", bound=BaseModel)

# Seconds a client should wait before retrying a 429: about how long a short request takes to finish.
_RETRY_AFTER_S = 1


@dataclass
class ServerState:
    """Everything route handlers use; built once at start-up, owned by one app."""

    config: ServerConfig
    engine: AsyncEngine
    tokenizer: object
    metrics: ServerMetrics
    model_names: list[str]
    max_model_len: int
    created: int
    text_limit: TextLimit
    body_limit: int
    """--max-body-size in bytes."""
    default_sampling: dict = field(default_factory=dict)
    """--generation-config defaults for the sampling fields a request leaves unset (OpenAI and Anthropic
    endpoints)."""
    loras: LoRARegistry = field(default_factory=lambda: LoRARegistry(False, None))
    """LoRA adapters by name (a request's `model` may name one)."""
    tool_parser: TaggedJsonParser | None = None
    """--tool-call-parser, resolved for the model (None: no parser known; tool_choice "auto" is refused)."""
    recent_prompts: RecentPrompts = field(default_factory=RecentPrompts)
    """The latest prompts, for the prefix-cache report (server/prefix_report.py)."""
    kv_events: object | None = None
    """--kv-events-config: the KVEventFeed behind GET /kv_events (server/kv_events.py); None: off."""
    draining: bool = False
    """Set on SIGTERM: new requests get 503 while in-flight ones finish."""
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer"))
    """NOTE: one thread: a fast tokenizer must not be entered by two threads at once (its Rust side panics
    with "Already borrowed"), and it keeps templates and long texts off the event loop."""

    async def off_loop(self, fn, *args, **kwargs):
        """Run tokenization / chat-template rendering on the tokenizer thread, so the event loop (health
        checks, streams of other requests) never waits on it."""
        return await asyncio.get_running_loop().run_in_executor(
            self.tokenizer_thread, functools.partial(fn, *args, **kwargs))

    def prefix_report(self) -> dict:
        """The prefix-cache report over the recent prompts (call off the event loop: it decodes)."""
        decode = getattr(self.tokenizer, "decode", None)
        return build_report(self.recent_prompts, self.engine.info.block_size, decode).to_dict()

    def _record_prompts(self, prompts: list[Prompt]) -> None:
        """Keep the prompts for the prefix-cache report; log the report when its interval is due."""
        interval = self.config.prefix_report_interval
        if not self.config.enable_debug_endpoints and interval <= 0:
            return
        for p in prompts:
            self.recent_prompts.record(p.token_ids, p.text)
        if self.recent_prompts.log_due(interval):
            # NOTE: on the tokenizer thread (it decodes), not awaited: the request does not wait for the report.
            asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, self._log_prefix_report)

    def _log_prefix_report(self) -> None:
        decode = getattr(self.tokenizer, "decode", None)
        for d in build_report(self.recent_prompts, self.engine.info.block_size, decode).divergences[:3]:
            logger.info(d.log_line(with_text=self.config.log_requests))

    def resolve_model(self, requested: str | None) -> str:
        """The model name to answer with (the base model or a LoRA adapter); 404 for one this server does not
        serve."""
        if requested is None or requested == "":
            return self.model_names[0]
        if requested not in self.model_names and self.loras.get(requested) is None:
            served = self.model_names + self.loras.names
            raise APIError(404, f"The model `{requested}` does not exist; this server serves "
                                f"{', '.join(served)}", param="model", code="model_not_found")
        return requested

    def check_request(self, params: SamplingParams, num_prompts: int = 1) -> None:
        """Per-request limits (limits.py), then: no new work while shutting down."""
        check_sampling(self.config, params, num_prompts, self.engine.capacity)
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")

    async def check_structured_outputs(self, params: SamplingParams, param: str) -> None:
        """An invalid or unsupported grammar -> 400 naming it (checked off the event loop: a large schema
        takes a while to parse)."""
        if params.structured_outputs is None:
            return
        try:
            await self.off_loop(self.engine.processor.check_structured_outputs, params.structured_outputs)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    async def open_streams(self, request_id: str, prompts: list[Prompt], params: SamplingParams,
                           prompt_param: str = "prompt",
                           cache_pin: tuple[int, float] | None = None,
                           model: str | None = None) -> list[RequestStream]:
        """Queue one engine request per prompt, all or none. Raises APIError (400, 429, 500, 503).

        cache_pin: (prefix tokens, TTL seconds) pinned in the prefix cache for every prompt.
        model: the resolved model name; a LoRA adapter's runs with that adapter."""
        lora_request = self.loras.get(model)
        self.check_request(params, len(prompts))
        engine = self.engine
        if engine.num_inflight_seqs + params.n * len(prompts) > engine.capacity:
            self.metrics.on_rejected("queue_full")
            raise _overloaded(engine)
        ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        timeout = self.config.request_timeout
        deadline = asyncio.get_running_loop().time() + timeout if timeout > 0 else None
        if self.config.log_requests:
            for rid, p in zip(ids, prompts):
                logger.info("request %s: prompt %r (token ids %s), params %s", rid, p.text, p.token_ids, params)
        results = await asyncio.gather(
            *(engine.add_request(rid, p.token_ids, params, p.text, cache_pin, deadline, lora_request)
              for rid, p in zip(ids, prompts)),
            return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if not isinstance(r, RequestStream)]
        if not errors:
            self._record_prompts(prompts)  # accepted, so their token ids are valid
            return streams
        for stream in streams:
            stream.close()
        error = errors[0]
        if isinstance(error, EngineOverloadedError):
            self.metrics.on_rejected("queue_full")
            raise _overloaded(engine)
        if isinstance(error, ValueError):
            self.metrics.on_rejected("invalid_request")
            raise _engine_rejection(str(error), prompt_param)
        if isinstance(error, Exception):
            raise stream_error(error)
        raise error


def stream_error(e: Exception) -> APIError:
    """The HTTP error for an exception raised while a request ran (or while queuing it)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not available: {e}")
    if isinstance(e, RequestAbortedError):
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, RequestTimeoutError):
        return APIError(408, str(e), code="request_timeout")
    if isinstance(e, EngineInternalError):
        return APIError(500, f"the request failed in the engine: {e}")
    logger.error("request failed: %s: %s", type(e).__name__, e)
    return APIError(500, f"generation failed: {type(e).__name__}")


def check_output(out: RequestOutput) -> RequestOutput:
    """Raises APIError 500 if a sequence of the request failed in the engine (finish_reason "error")."""
    for o in out.outputs:
        if o.finish_reason == "error":
            raise APIError(500, f"the request failed in the engine: {o.error}")
    return out


def _overloaded(engine: AsyncEngine) -> APIError:
    return APIError(429, f"the server is at capacity ({engine.args.max_num_seqs} running + "
                         f"{engine.max_queue_len} waiting sequences); retry later",
                    code="rate_limit_exceeded", headers={"Retry-After": str(_RETRY_AFTER_S)})


def _engine_rejection(message: str, prompt_param: str) -> APIError:
    code = "context_length_exceeded" if "max_model_len" in message else None
    param = ("max_tokens" if "max_tokens" in message
             else "prompt_logprobs" if message.startswith("prompt_logprobs") else prompt_param if "prompt" in message
             else "logprobs" if "logprobs" in message else "logit_bias" if "logit_bias" in message
             else "stop_token_ids" if "stop_token_ids" in message
             else "structured_outputs" if "structured_outputs" in message else None)
    return APIError(400, message, param=param, code=code)


def with_output_kind(params: SamplingParams, stream: bool) -> SamplingParams:
    """A stream needs only what is new at each step; a whole response only the final output."""
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return params.clone(output_kind=kind)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def read_body(request: Request, model: type[M], max_bytes: int) -> M:
    """The body parsed strictly into `model`: 415 unless it is declared JSON, 413 past max_bytes, 400 for
    bad JSON or wrong types."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"the request body must be JSON sent with `Content-Type: application/json`, "
                            f"got {media_type or 'no content type'}", code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:  # NOTE: chunked bodies carry no content-length; count as they arrive
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        # NOTE: the client left mid-body, or uvicorn's parser gave up on it (a malformed chunked body: it has
        # already answered 400 and closed); an error, not a traceback in the log
        raise APIError(400, "the request body ended before it was complete (the connection closed)",
                       code="incomplete_body") from None
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as e:
        raise from_validation_error(e) from None


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body exceeds the server's limit of {max_bytes} bytes (--max-body-size)",
                    code="request_too_large")


async def read_request(state: ServerState, request: Request, model: type[M]) -> M:
    """read_body with the server's body limit."""
    return await read_body(request, model, state.body_limit)


def sse(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; one stream is read directly."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                merged.put_nowait((i, out))
        except Exception as e:
            merged.put_nowait((i, e))
        merged.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


class EventStream(StreamingResponse):
    """text/event-stream whose `on_close` runs however the response ends: normally, or because the
    client went away (Starlette cancels the response task), so unfinished requests are aborted."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def close_all(streams: list[RequestStream]) -> Callable[[], None]:
    def close() -> None:
        for stream in streams:
            stream.close()
    return close


async def unless_disconnected(request: Request, work: Awaitable[Response],
                              streams: list[RequestStream]) -> Response:
    """Run a non-streaming handler, aborting its requests if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            close_all(streams)()
            task.cancel()
            # NOTE: cancel() only asks; the task must run to its end before its state can be read.
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # NOTE: nginx's "client closed request"; nobody reads it
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def error_event(e: Exception) -> str:
    return sse(stream_error(e).body())


async def final_output(stream: RequestStream) -> RequestOutput:
    """Drain one request's stream and return its last (final) output. Raises APIError: 503 (engine
    stopped, server shutting down), 408 (deadline), 500 (the request failed in the engine)."""
    final = None
    try:
        async for out in stream:
            final = out
    except Exception as e:
        raise stream_error(e) from None
    return check_output(final)
