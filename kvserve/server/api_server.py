"""The FastAPI app: routes, API-key check, and the start-up / shutdown of the AsyncEngine.

Routes are thin: they parse and delegate to serving_completions / serving_chat / serving_messages
(Anthropic) / serving_debug, which talk to the engine only through AsyncEngine. All server state lives
in one ServerState on `app.state`.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import kvserve
from kvserve.config import EngineArgs
from kvserve.engine.async_engine import AsyncEngine
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError, install_error_handlers
from kvserve.server.metrics import ServerMetrics, log_stats_periodically
from kvserve.server.prompts import chat_prompt, render_chat
from kvserve.server.protocol import (ChatCompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard,
                                     ModelList, TokenizeRequest, TokenizeResponse)
from kvserve.server.serving import ServerState, read_body
from kvserve.server.serving_chat import create_chat_completion
from kvserve.server.serving_completions import create_completion
from kvserve.server.serving_debug import explain_prefix, prefix_cache_stats
from kvserve.server.serving_messages import count_tokens, create_message

logger = logging.getLogger("kvserve.server")


def _state(request: Request) -> ServerState:
    return request.app.state.kvserve


def build_app(config: ServerConfig, engine_args: EngineArgs) -> FastAPI:
    """An app that starts the engine in its lifespan (so on the server's own event loop)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = AsyncEngine(engine_args, max_queue_len=config.max_queue_len,
                             use_process=config.engine_loop == "process")
        info = await engine.start()
        names = [config.served_model_name or info.model_name]
        metrics = ServerMetrics(names[0])
        engine.add_listener(metrics.on_step)
        app.state.kvserve = ServerState(config, engine, engine.tokenizer, metrics, names, info.max_model_len,
                                        int(time.time()))
        stats_task = None
        if config.stats_interval > 0:
            stats_task = asyncio.create_task(log_stats_periodically(metrics, lambda: engine.stats,
                                                                    config.stats_interval))
        logger.info("engine ready (%s, %s): model %s, max_model_len %d, %d KV blocks of %d tokens",
                    config.engine_loop, engine_args.device, names[0],
                    info.max_model_len, info.num_kv_blocks, info.block_size)
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await engine.shutdown()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan)
    install_error_handlers(app)

    async def check_api_key(request: Request) -> None:
        if config.api_key is None:
            return
        # OpenAI clients send `Authorization: Bearer KEY`, Anthropic clients `x-api-key: KEY`; either works.
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        offered = [token.strip()] if scheme.lower() == "bearer" else []
        offered += [request.headers["x-api-key"].strip()] if "x-api-key" in request.headers else []
        if not any(hmac.compare_digest(key.encode(), config.api_key.encode()) for key in offered):
            raise APIError(401, "invalid or missing API key (send `Authorization: Bearer KEY` or `x-api-key: KEY`)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    _add_routes(app, [Depends(check_api_key)])
    return app


def _forward(handler):
    """An endpoint whose only parameter is the request (so FastAPI reads nothing else from it)."""
    async def endpoint(request: Request) -> Response:
        return await handler(_state(request), request)
    return endpoint


def _add_routes(app: FastAPI, auth: list) -> None:
    # Endpoints whose handler takes the server state and the request as they are.
    forwarded = {"/v1/completions": create_completion, "/v1/chat/completions": create_chat_completion,
                 "/v1/messages": create_message, "/v1/messages/count_tokens": count_tokens,
                 "/debug/prefix-cache/explain": explain_prefix}
    for path, handler in forwarded.items():
        app.add_api_route(path, _forward(handler), methods=["POST"], dependencies=auth, name=handler.__name__)

    @app.get("/debug/prefix-cache", dependencies=auth)
    async def debug_prefix_cache(request: Request) -> Response:
        return await prefix_cache_stats(_state(request))

    @app.get("/v1/models", dependencies=auth)
    async def models(request: Request) -> Response:
        s = _state(request)
        cards = [ModelCard(id=name, created=s.created, root=s.engine.args.model or name,
                           max_model_len=s.max_model_len) for name in s.model_names]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> Response:
        s = _state(request)
        body = await read_body(request, TokenizeRequest, s.config.max_body_size_bytes)
        s.resolve_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of `prompt` and `messages`", param="prompt")
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages)
            text = render_chat(s.tokenizer, chat.conversation(), bool(body.add_generation_prompt))
            ids = chat_prompt(s.tokenizer, text).token_ids
        else:
            ids = s.tokenizer.encode(body.prompt, add_special_tokens=bool(body.add_special_tokens))
        strs = s.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        out = TokenizeResponse(count=len(ids), max_model_len=s.max_model_len, tokens=ids, token_strs=strs)
        return Response(out.model_dump_json(), media_type="application/json")

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> Response:
        s = _state(request)
        body = await read_body(request, DetokenizeRequest, s.config.max_body_size_bytes)
        s.resolve_model(body.model)
        vocab = len(s.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        text = s.tokenizer.decode(body.tokens)
        return Response(DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health(request: Request) -> Response:
        engine = _state(request).engine
        if not engine.is_running:
            raise APIError(503, f"the engine is not running: {engine.dead_reason}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kvserve.__version__})
