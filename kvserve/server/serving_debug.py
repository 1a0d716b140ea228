"""Prefix-cache debug endpoints: why a prompt (did not) hit the cache, and the cache's totals.

    POST /debug/prefix-cache/explain  {"prompt": str | [ids]} or {"messages": [...]}  -> Engine.explain_prefix
    GET  /debug/prefix-cache                                                        -> Engine.prefix_cache_stats
    GET  /debug/prefix-cache/report  -> recent prompts whose shared prefix a varying span cuts short
                                        (server/prefix_report.py; answered by the server process)

The engine may live in another process, so both go through the AsyncEngine's query messages and are
answered between two steps. NOTE: explain shows snippets of cached text, which may come from other
clients' prompts: they are served only with --enable-debug-endpoints, and behind --api-key.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from kvserve.server.errors import APIError
from kvserve.server.limits import check_messages
from kvserve.server.prompts import completion_prompts, render_chat_prompt
from kvserve.server.protocol import ExplainPrefixRequest, conversation_of
from kvserve.server.serving import ServerState, read_request, stream_error


async def explain_prefix(state: ServerState, raw_request: Request) -> JSONResponse:
    body = await read_request(state, raw_request, ExplainPrefixRequest)
    lora_request = state.loras.get(state.resolve_model(body.model))  # an adapter's blocks are its own
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of `prompt` and `messages`", param="prompt")
    if body.messages is not None:
        check_messages(state.config, len(body.messages))
        # NOTE: rendered exactly as /v1/chat/completions renders it, so the ids are the ones a chat request sends.
        conversation = conversation_of(body.messages)
        prompt = await state.off_loop(render_chat_prompt, state.tokenizer, conversation, state.text_limit)
        token_ids: list[int] = prompt.token_ids
    elif isinstance(body.prompt, str):
        (prompt,) = await state.off_loop(completion_prompts, state.tokenizer, body.prompt, state.text_limit)
        token_ids = prompt.token_ids
    else:
        token_ids = body.prompt
    try:
        return JSONResponse(await state.engine.explain_prefix(token_ids, lora_request))
    except ValueError as e:
        raise APIError(400, str(e), param="prompt") from None
    except Exception as e:
        raise stream_error(e) from None


async def prefix_cache_stats(state: ServerState) -> JSONResponse:
    try:
        return JSONResponse(await state.engine.prefix_cache_stats())
    except Exception as e:
        raise stream_error(e) from None


async def prefix_cache_report(state: ServerState) -> JSONResponse:
    """Answered in the server process, from the prompts it saw (the engine is not asked)."""
    return JSONResponse(await state.off_loop(state.prefix_report))
