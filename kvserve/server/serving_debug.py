"""Prefix-cache debug endpoints: why a prompt (did not) hit the cache, and the cache's totals.

    POST /debug/prefix-cache/explain  {"prompt": str | [ids]} or {"messages": [...]}  -> Engine.explain_prefix
    GET  /debug/prefix-cache                                                        -> Engine.prefix_cache_stats

The engine may live in another process, so both go through the AsyncEngine's query messages and are
answered between two steps. NOTE: explain shows snippets of cached text, which may come from other
clients' prompts; like every /v1 route these sit behind --api-key.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from kvserve.engine.async_engine import EngineDeadError
from kvserve.server.errors import APIError
from kvserve.server.prompts import chat_prompt, render_chat
from kvserve.server.protocol import ChatCompletionRequest, ExplainPrefixRequest
from kvserve.server.serving import ServerState, read_body


async def explain_prefix(state: ServerState, raw_request: Request) -> JSONResponse:
    body = await read_body(raw_request, ExplainPrefixRequest, state.config.max_body_size_bytes)
    state.resolve_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of `prompt` and `messages`", param="prompt")
    if body.messages is not None:
        # NOTE: rendered exactly as /v1/chat/completions renders it, so the ids are the ones a chat request sends.
        text = render_chat(state.tokenizer, ChatCompletionRequest(messages=body.messages).conversation())
        prompt: str | list[int] = chat_prompt(state.tokenizer, text).token_ids
    else:
        prompt = body.prompt
    try:
        return JSONResponse(await state.engine.explain_prefix(prompt))
    except ValueError as e:
        raise APIError(400, str(e), param="prompt") from None
    except EngineDeadError as e:
        raise APIError(503, f"the engine is not available: {e}") from None


async def prefix_cache_stats(state: ServerState) -> JSONResponse:
    try:
        return JSONResponse(await state.engine.prefix_cache_stats())
    except EngineDeadError as e:
        raise APIError(503, f"the engine is not available: {e}") from None
