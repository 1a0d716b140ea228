"""The FastAPI app: routes, API-key check, and the start-up / shutdown of the AsyncEngine.

Routes are thin: they parse and delegate to serving_completions / serving_chat / serving_messages
(Anthropic) / serving_debug, which talk to the engine only through AsyncEngine. All server state lives
in one ServerState on `app.state`.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import kvserve
from kvserve.config import EngineArgs
from kvserve.config.kv_events import KVEventsConfig
from kvserve.engine.data_parallel import create_async_engine
from kvserve.kv_cache.admission_check import admission_warning
from kvserve.engine.engine_process import EngineProcess
from kvserve.server.config import ServerConfig
from kvserve.server.kv_events import KVEventFeed
from kvserve.server.errors import APIError, install_error_handlers
from kvserve.server.metrics import ServerMetrics, log_stats_periodically
from kvserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvserve.server.limits import check_messages
from kvserve.server.lora_registry import LoRARegistry, parse_lora_modules
from kvserve.server.openapi import request_body_schema
from kvserve.server.prompts import TextLimit, render_chat_prompt
from kvserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                     LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest,
                                     ExplainPrefixRequest, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
                                     conversation_of)
from kvserve.server.serving import ServerState, read_request
from kvserve.server.serving_chat import create_chat_completion
from kvserve.server.serving_completions import create_completion
from kvserve.server.serving_debug import explain_prefix, prefix_cache_report, prefix_cache_stats
from kvserve.server.serving_messages import count_tokens, create_message
from kvserve.server.tool_parsers import resolve_tool_parser

logger = logging.getLogger("kvserve.server")


def _state(request: Request) -> ServerState:
    return request.app.state.kvserve


def build_app(config: ServerConfig, engine_args: EngineArgs,
              on_ready: Callable[[], None] | None = None,
              on_engine_dead: Callable[[str], None] | None = None,
              engine_process: EngineProcess | None = None) -> FastAPI:
    """An app that starts the engine in its lifespan (so on the server's own event loop).

    on_ready: called once the engine is up (the CLI prints where it serves then).
    on_engine_dead: called if the engine loop dies (the CLI then exits non-zero, for a supervisor).
    engine_process: the engine process `kvserve serve` started before its imports (engine/engine_process.py)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = create_async_engine(engine_args, max_queue_len=config.max_queue_len,
                                     use_process=config.engine_loop == "process", engine_process=engine_process)
        info = await engine.start()
        names = [config.served_model_name or info.model_name]
        metrics = ServerMetrics(names[0], info.kv_cache_dtype, info.kv_cache_bytes, engine_health=engine.health)
        engine.add_listener(metrics.on_step)
        if config.log_requests:
            engine.add_listener(_log_finished)
        if on_engine_dead is not None:
            engine.add_dead_listener(on_engine_dead)
        state = ServerState(config, engine, engine.tokenizer, metrics, names, info.max_model_len,
                            int(time.time()), TextLimit.of(engine.tokenizer, info.max_model_len),
                            config.body_limit(info.max_model_len),
                            default_sampling=engine.default_sampling,
                            loras=LoRARegistry(engine_args.enable_lora, config.allowed_lora_dirs),
                            tool_parser=resolve_tool_parser(config.tool_call_parser,
                                                            getattr(engine.tokenizer, "chat_template", None)))
        app.state.kvserve = state
        events_config = KVEventsConfig.parse(engine_args.kv_events_config)
        if events_config is not None and events_config.enabled:
            state.kv_events = KVEventFeed(events_config, info.block_size)
            engine.add_listener(state.kv_events.on_step)
            logger.info("KV events: GET /kv_events (publisher %s)", events_config.publisher or "http")
        try:
            for name, path in parse_lora_modules(config.lora_modules):
                await state.loras.load(name, path, names, lambda r: state.off_loop(engine.check_lora, r))
        except (ValueError, APIError) as e:
            await engine.shutdown()
            raise RuntimeError(f"--lora-modules: {getattr(e, 'message', e)}") from None
        logger.info("default sampling parameters (--generation-config %s): %s", engine_args.generation_config,
                    state.default_sampling or "none (the API's own)")
        logger.info("tool calling: parser %s (--tool-call-parser %s), auto tool choice %s",
                    state.tool_parser.name if state.tool_parser else "none", config.tool_call_parser,
                    "on" if config.enable_auto_tool_choice and state.tool_parser else "off")
        if state.loras.names:
            logger.info("LoRA adapters: %s", ", ".join(f"{r.lora_name} ({r.lora_path})" for r in state.loras.adapters()))
        stats_task = None
        if config.stats_interval > 0:
            stats_task = asyncio.create_task(log_stats_periodically(metrics, lambda: engine.stats,
                                                                    config.stats_interval))
        logger.info("engine ready (%s, %s): model %s, max_model_len %d, %d KV blocks of %d tokens (%s)",
                    config.engine_loop, engine_args.device, names[0],
                    info.max_model_len, info.num_kv_blocks, info.block_size, info.kv_cache_dtype)
        logger.info("limits: body %d bytes, prompt text %d characters, n %d, stop strings %d of <= %d "
                    "characters, messages %d, logit_bias %d, max_tokens %s, request timeout %s",
                    state.body_limit, state.text_limit.max_chars, config.max_n, config.max_stop_strings,
                    config.max_stop_string_length, config.max_messages, config.max_logit_bias,
                    config.max_tokens_limit or "up to max_model_len",
                    f"{config.request_timeout:g} s" if config.request_timeout else "none")
        _warn_if_admission_collapses(info, state, engine_args)
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await engine.shutdown()
            state.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan)
    install_error_handlers(app)
    keys = config.api_keys
    # NOTE: digests of equal length, so comparing costs the same whatever the key or the guess.
    digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    async def check_api_key(request: Request) -> None:
        if not keys:
            return
        # OpenAI clients send `Authorization: Bearer KEY`, Anthropic clients `x-api-key: KEY`; either works.
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        offered = [token.strip()] if scheme.lower() == "bearer" else []
        offered += [request.headers["x-api-key"].strip()] if "x-api-key" in request.headers else []
        # NOTE: every (offer, key) pair is compared, with no early exit, so timing says nothing of which
        # key (or whether a prefix) matched.
        matches = [hmac.compare_digest(hashlib.sha256(o.encode()).digest(), d) for o in offered for d in digests]
        if not any(matches):
            raise APIError(401, "invalid or missing API key (send `Authorization: Bearer KEY` or `x-api-key: KEY`)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(check_api_key)]
    _add_routes(app, auth, metrics_auth=auth if config.require_api_key_for_metrics else [])
    if config.enable_debug_endpoints:
        _add_debug_routes(app, auth)
    return app


def _warn_if_admission_collapses(info, state: ServerState, engine_args: EngineArgs) -> None:
    """The playbook's pitfall 1, at start-up: few requests fit the KV pool at the length they may grow to."""
    warning = admission_warning(
        pool_tokens=info.num_kv_blocks * info.block_size, max_model_len=info.max_model_len,
        max_num_seqs=info.max_num_seqs, default_max_tokens=state.default_sampling.get("max_tokens"),
        max_tokens_limit=state.config.max_tokens_limit, kv_reservation=engine_args.kv_reservation,
        max_tokens_held=info.max_blocks_per_request and info.max_blocks_per_request * info.block_size)
    if warning is not None:
        logger.warning(warning)


def _log_finished(report) -> None:
    for out in report.outputs:
        if out.finished:
            for o in out.outputs:
                logger.info("request %s finished (%s): output %r", out.request_id, o.finish_reason, o.text)


def _forward(handler):
    """An endpoint whose only parameter is the request (so FastAPI reads nothing else from it)."""
    async def endpoint(request: Request) -> Response:
        return await handler(_state(request), request)
    return endpoint


def _add_debug_routes(app: FastAPI, auth: list) -> None:
    app.add_api_route("/debug/prefix-cache/explain", _forward(explain_prefix), methods=["POST"],
                      dependencies=auth, name="explain_prefix",
                      openapi_extra=request_body_schema(ExplainPrefixRequest))

    @app.get("/debug/prefix-cache", dependencies=auth)
    async def debug_prefix_cache(request: Request) -> Response:
        return await prefix_cache_stats(_state(request))

    @app.get("/debug/prefix-cache/report", dependencies=auth)
    async def debug_prefix_cache_report(request: Request) -> Response:
        return await prefix_cache_report(_state(request))


def _add_routes(app: FastAPI, auth: list, metrics_auth: list) -> None:
    # Endpoints whose handler takes the server state and the request as they are.
    forwarded = {"/v1/completions": (create_completion, CompletionRequest),
                 "/v1/chat/completions": (create_chat_completion, ChatCompletionRequest),
                 "/v1/messages": (create_message, MessagesRequest),
                 "/v1/messages/count_tokens": (count_tokens, CountTokensRequest)}
    for path, (handler, body) in forwarded.items():
        app.add_api_route(path, _forward(handler), methods=["POST"], dependencies=auth, name=handler.__name__,
                          openapi_extra=request_body_schema(body))

    @app.get("/v1/models", dependencies=auth)
    async def models(request: Request) -> Response:
        s = _state(request)
        cards = [ModelCard(id=name, created=s.created, root=s.engine.args.model or name,
                           max_model_len=s.max_model_len) for name in s.model_names]
        cards += [ModelCard(id=r.lora_name, created=s.created, root=r.lora_path, parent=s.model_names[0],
                            max_model_len=s.max_model_len) for r in s.loras.adapters()]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.post("/v1/load_lora_adapter", dependencies=auth, openapi_extra=request_body_schema(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> Response:
        s = _state(request)
        body = await read_request(s, request, LoadLoRAAdapterRequest)
        await s.loras.load(body.lora_name, body.lora_path, s.model_names,
                           lambda r: s.off_loop(s.engine.check_lora, r))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=auth,
              openapi_extra=request_body_schema(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> Response:
        s = _state(request)
        body = await read_request(s, request, UnloadLoRAAdapterRequest)
        s.loras.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize", dependencies=auth, openapi_extra=request_body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        s = _state(request)
        body = await read_request(s, request, TokenizeRequest)
        s.resolve_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of `prompt` and `messages`", param="prompt")
        if body.messages is not None:
            check_messages(s.config, len(body.messages))
            prompt = await s.off_loop(render_chat_prompt, s.tokenizer, conversation_of(body.messages),
                                      s.text_limit, bool(body.add_generation_prompt))
            ids = prompt.token_ids
        else:
            s.text_limit.check(body.prompt, "prompt")
            ids = await s.off_loop(s.tokenizer.encode, body.prompt, add_special_tokens=bool(body.add_special_tokens))
        strs = await s.off_loop(s.tokenizer.convert_ids_to_tokens, ids) if body.return_token_strs else None
        out = TokenizeResponse(count=len(ids), max_model_len=s.max_model_len, tokens=ids, token_strs=strs)
        return Response(out.model_dump_json(), media_type="application/json")

    @app.post("/detokenize", dependencies=auth, openapi_extra=request_body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        s = _state(request)
        body = await read_request(s, request, DetokenizeRequest)
        s.resolve_model(body.model)
        vocab = len(s.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        text = await s.off_loop(s.tokenizer.decode, body.tokens)
        return Response(DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health(request: Request) -> Response:
        s = _state(request)
        if not s.engine.is_running:
            raise APIError(503, f"the engine is not running: {s.engine.dead_reason}")
        if s.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        engines = s.engine.health()
        if len(engines) == 1:
            return Response(status_code=200)
        # --data-parallel-size: the server answers while one engine serves; the body says which do not
        status = "ok" if all(e["running"] for e in engines) else "degraded"
        return JSONResponse({"status": status, "engines": engines})

    @app.get("/kv_events", dependencies=auth)
    async def kv_events(request: Request, since: int = 0, timeout: float = 0.0) -> Response:
        s = _state(request)
        if s.kv_events is None:
            raise APIError(404, "KV events are off (start the server with --kv-events-config "
                                "'{\"enable_kv_cache_events\": true}')", code="kv_events_disabled")
        return await s.kv_events.answer(since, timeout)

    @app.get("/metrics", dependencies=metrics_auth)
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kvserve.__version__})
