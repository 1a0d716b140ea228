"""POST /v1/messages (Anthropic's Messages API) and POST /v1/messages/count_tokens.

The conversation goes through the same chat template as /v1/chat/completions. A stream follows
Anthropic's event sequence, each event framed as `event: NAME` + `data: JSON`:

    message_start -> content_block_start -> ping -> content_block_delta* -> content_block_stop
    -> message_delta (stop_reason, usage) -> message_stop

message_start is sent with the engine's first output, not before: its usage carries the cache fields,
and how much of the prompt the cache served is known only once the request was admitted.
"""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from kvserve.engine.async_engine import RequestStream
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.anthropic_protocol import (CacheCreation, CountTokensRequest, CountTokensResponse,
                                               MessageResponse, MessagesRequest, TextContent, Usage)
from kvserve.server.cache_control import TTL_SECONDS, breakpoint_num_tokens, cache_usage, conversation
from kvserve.server.errors import APIError
from kvserve.server.limits import check_messages
from kvserve.server.prompts import Prompt, render_chat_prompt
from kvserve.server.serving import (EventStream, ServerState, check_output, close_all, final_output, read_request,
                                    stream_error, unless_disconnected, with_output_kind)

logger = logging.getLogger("kvserve.server")

# Anthropic answers "the service is overloaded" with 529; our admission limit is exactly that.
_OVERLOADED = 529


async def create_message(state: ServerState, raw_request: Request) -> Response:
    request = await read_request(state, raw_request, MessagesRequest)
    model = state.resolve_model(request.model)
    request.check_supported()
    check_messages(state.config, len(request.messages))
    params = with_output_kind(request.to_sampling_params(state.default_sampling), bool(request.stream))
    state.check_request(params)
    prompt = await state.off_loop(_render, state, request)
    num_pin_tokens, ttl = await state.off_loop(_cache_pin, state, request, prompt)
    run = _MessageRun(model, params, num_pin_tokens, ttl, state.engine.info.block_size)
    try:
        cache_pin = (num_pin_tokens, TTL_SECONDS[ttl]) if num_pin_tokens else None
        streams = await state.open_streams(run.id, [prompt], params, prompt_param="messages", cache_pin=cache_pin,
                                           model=model)
    except APIError as e:
        if e.status_code == 429:
            raise APIError(_OVERLOADED, e.message, headers=e.headers) from None
        raise
    if request.stream:
        return EventStream(run.events(streams[0]), close_all(streams))
    return await unless_disconnected(raw_request, run.respond(streams[0]), streams)


async def count_tokens(state: ServerState, raw_request: Request) -> Response:
    request = await read_request(state, raw_request, CountTokensRequest)
    state.resolve_model(request.model)
    request.check_supported()
    check_messages(state.config, len(request.messages))
    request.cache_breakpoints()  # validated like a Messages request, though nothing is pinned
    prompt = await state.off_loop(_render, state, request)
    body = CountTokensResponse(input_tokens=len(prompt.token_ids))
    return Response(body.model_dump_json(), media_type="application/json")


def _render(state: ServerState, request: CountTokensRequest) -> Prompt:
    prefill = request.continues_assistant
    return render_chat_prompt(state.tokenizer, conversation(request.conversation_parts()), state.text_limit,
                              add_generation_prompt=not prefill, continue_final_message=prefill)


def _cache_pin(state: ServerState, request: CountTokensRequest, prompt: Prompt) -> tuple[int, str]:
    """(prefix tokens, TTL) of the last cache_control breakpoint, the longest prefix; 0 tokens for none."""
    breakpoints = request.cache_breakpoints()
    if not breakpoints:
        return 0, "5m"
    bp = breakpoints[-1]
    try:
        num_tokens = breakpoint_num_tokens(state.tokenizer, request.conversation_parts(), bp, prompt.token_ids)
    except APIError as e:
        # NOTE: some templates refuse a truncated conversation; caching is an optimization, so the request
        # runs unpinned rather than failing.
        logger.warning("cache_control ignored: the chat template cannot render the prefix (%s)", e.message)
        return 0, bp.ttl
    return num_tokens, bp.ttl


def _stop(o) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for an engine completion."""
    if o.finish_reason == "length":
        return "max_tokens", None
    if isinstance(o.stop_reason, str):
        return "stop_sequence", o.stop_reason
    return "end_turn", None  # EOS (or an abort nobody reads)


def _event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n"


class _MessageRun:
    """Formats one Messages request's engine outputs (streamed or whole)."""

    def __init__(self, model: str, params: SamplingParams, num_pin_tokens: int, pin_ttl: str, block_size: int):
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model, self.params = model, params
        self.num_pin_tokens, self.pin_ttl, self.block_size = num_pin_tokens, pin_ttl, block_size

    def _usage(self, out: RequestOutput, num_output_tokens: int) -> Usage:
        c = cache_usage(len(out.prompt_token_ids), out.num_cached_tokens, self.num_pin_tokens, self.block_size)
        created = c.cache_creation_input_tokens
        by_ttl = CacheCreation(ephemeral_5m_input_tokens=created if self.pin_ttl == "5m" else 0,
                               ephemeral_1h_input_tokens=created if self.pin_ttl == "1h" else 0)
        return Usage(input_tokens=c.input_tokens, output_tokens=num_output_tokens,
                     cache_creation_input_tokens=created, cache_read_input_tokens=c.cache_read_input_tokens,
                     cache_creation=by_ttl)

    def _message(self, out: RequestOutput, text: str, finished: bool, num_output_tokens: int) -> MessageResponse:
        stop_reason, stop_sequence = _stop(out.outputs[0]) if finished else (None, None)
        return MessageResponse(id=self.id, model=self.model, content=[TextContent(text=text)] if finished else [],
                               stop_reason=stop_reason, stop_sequence=stop_sequence,
                               usage=self._usage(out, num_output_tokens))

    async def respond(self, stream: RequestStream) -> Response:
        final = await final_output(stream)
        body = self._message(final, final.outputs[0].text, True, stream.num_output_tokens[0])
        return Response(body.model_dump_json(), media_type="application/json")

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        final = None
        try:
            async for out in stream:
                check_output(out)
                if final is None:
                    yield _event("message_start", {"type": "message_start",
                                                   "message": self._message(
                                                       out, "", False, stream.num_output_tokens[0]).model_dump()})
                    yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                         "content_block": {"type": "text", "text": ""}})
                    yield _event("ping", {"type": "ping"})
                final = out
                text = out.new_texts[0]
                if text:
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                         "delta": {"type": "text_delta", "text": text}})
            stop_reason, stop_sequence = _stop(final.outputs[0])
            yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            usage = self._usage(final, stream.num_output_tokens[0]).model_dump(exclude={"cache_creation"})
            yield _event("message_delta", {"type": "message_delta", "usage": usage,
                                           "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}})
            yield _event("message_stop", {"type": "message_stop"})
        except Exception as e:  # the stream already said 200: report in-band, as Anthropic does
            yield _event("error", stream_error(e).anthropic_body())
