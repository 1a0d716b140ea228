"""The router's FastAPI app: an OpenAI-compatible front for several `kvserve serve` workers, or (with
--pd-disaggregation, and as `kvserve proxy`) for a pool of prefill instances and a pool of decode instances
(router/pd.py: each request goes to one of each).

    POST /v1/completions, /v1/chat/completions   routed by the policy, answered (streamed) as the worker answers
    GET  /v1/models                              a healthy worker's (disaggregated: a decode instance's)
    GET  /health                                 200 while every pool has a healthy worker, else 503
    GET  /workers                                each worker's URL, role (worker, prefill or decode), health,
                                                 in-flight requests (and, precise: how many of its cached blocks
                                                 the router knows of)

Background tasks: the health polls, the prefix trees' pruning (cache_aware) and one KV-event follower per
worker (precise). Errors are OpenAI error JSON: 503 when no worker is healthy, 502 when every one tried failed.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.router.blocks import WorkerBlocks, follow_events
from kvserve.router.config import RouterConfig
from kvserve.router.keys import KeyMaker
from kvserve.router.pd import PDFlow
from kvserve.router.policies import CacheAware, PowerOfTwo, Precise, RoundRobin
from kvserve.router.proxy import Forwarder
from kvserve.router.workers import WorkerPool
from kvserve.server.errors import APIError, install_error_handlers

logger = logging.getLogger("kvserve.router")


def make_policy(config: RouterConfig, name: str | None = None):
    """name: the policy (default: --policy)."""
    name = name or config.policy
    if name == "round_robin":
        return RoundRobin()
    if name == "power_of_two":
        return PowerOfTwo()
    if name == "cache_aware":
        return CacheAware(config.cache_threshold, config.balance(), config.max_tree_size)
    return Precise(config.balance())


@dataclass
class Route:
    """One pool of workers (all of them; or the prefill or the decode instances), its policy and forwarder."""

    role: str
    pool: WorkerPool
    policy: object
    forwarder: Forwarder

    @classmethod
    def make(cls, config: RouterConfig, role: str, urls: tuple[str, ...], policy_name: str,
             client: httpx.AsyncClient) -> Route:
        pool = WorkerPool.of(list(urls), config.health_config())
        policy = make_policy(config, policy_name)
        pool.on_down.append(policy.forget)
        return cls(role, pool, policy, Forwarder(pool, client, policy.choose, name=role))


@dataclass
class RouterState:
    config: RouterConfig
    routes: list[Route]
    pd: PDFlow | None = None
    """--pd-disaggregation: the prefill-then-decode flow over routes[0] (prefill) and routes[1] (decode)."""
    keys: KeyMaker = field(default_factory=KeyMaker)
    tasks: list[asyncio.Task] = field(default_factory=list)
    key_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="kvserve-router-keys"))
    """NOTE: one thread: a fast tokenizer must not be entered by two threads at once; templating and
    tokenizing stay off the event loop."""


async def _load_tokenizer(config: RouterConfig, pool: WorkerPool, client: httpx.AsyncClient):
    """--tokenizer, else the model the first answering worker names at /v1/models; None if neither loads."""
    from kvserve.model_loader.loader import ModelSource, load_tokenizer

    source = config.tokenizer
    for worker in ([] if source else pool.healthy()):
        try:
            source = (await client.get(f"{worker.url}/v1/models", headers=config.worker_headers(),
                                       timeout=10)).json()["data"][0]["root"]
            break
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            continue
    try:
        tokenizer = await asyncio.to_thread(load_tokenizer, ModelSource.resolve(source))
    except Exception as e:
        logger.warning("no tokenizer (%s: %s): routing on the prompts' text only%s", source, e,
                       "; the precise policy then balances by load alone" if config.policy == "precise" else "")
        return None
    logger.info("routing keys from the tokenizer of %s", source)
    return tokenizer


async def _evict_forever(policy: CacheAware, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        policy.evict()


async def _start(state: RouterState, client: httpx.AsyncClient) -> None:
    config = state.config
    await asyncio.gather(*(route.pool.probe(client) for route in state.routes))
    if any(isinstance(route.policy, (CacheAware, Precise)) for route in state.routes):
        state.keys = KeyMaker(await _load_tokenizer(config, state.routes[-1].pool, client))
    for route in state.routes:
        policy = route.policy
        state.tasks.append(asyncio.create_task(route.pool.poll_forever(client)))
        if isinstance(policy, CacheAware):
            state.tasks.append(asyncio.create_task(_evict_forever(policy, config.eviction_interval_secs)))
        if isinstance(policy, Precise):
            for worker in route.pool.workers:
                blocks = policy.blocks.setdefault(worker.url, WorkerBlocks())
                state.tasks.append(asyncio.create_task(follow_events(
                    worker.url, blocks, client, config.health_check_interval_secs, config.worker_headers())))


def build_router_app(config: RouterConfig, on_ready: Callable[[], None] | None = None, *,
                     transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """transport: how the router reaches its workers (tests: in process); default: the network."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_secs, connect=5.0),
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                                   transport=transport)
        routes = [Route.make(config, role, urls, policy, client) for role, urls, policy in config.pools()]
        state = RouterState(config, routes)
        if config.pd_disaggregation:
            state.pd = PDFlow(routes[0].forwarder, routes[1].forwarder)
        app.state.router = state
        await _start(state, client)
        for route, (_, _, policy) in zip(routes, config.pools()):
            logger.info("routing with %s over %d %s(s): %s", policy, len(route.pool.workers), route.role,
                        ", ".join(f"{w.url} ({'up' if w.healthy else 'down'})" for w in route.pool.workers))
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            for task in state.tasks:
                task.cancel()
            await client.aclose()
            state.key_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvserve router", lifespan=lifespan)
    install_error_handlers(app)
    _add_routes(app)
    return app


def _state(request: Request) -> RouterState:
    return request.app.state.router


async def _route(request: Request, path: str) -> Response:
    state = _state(request)
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    key = await asyncio.get_running_loop().run_in_executor(state.key_thread, state.keys.key, path, body)
    if state.pd is not None:
        return await state.pd.forward(path, body, raw, request.headers, key, lambda: _disconnected(request))
    return await state.routes[0].forwarder.forward(path, raw, request.headers, key)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read: receive() waits for the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _add_routes(app: FastAPI) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _route(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        state = _state(request)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-api-key")}
        route = state.routes[-1]
        for worker in route.pool.healthy():
            try:
                answer = await route.forwarder.client.get(f"{worker.url}/v1/models", headers=headers, timeout=10)
            except httpx.HTTPError:
                continue
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))
        raise APIError(503, "no healthy worker", code="no_healthy_worker")

    @app.get("/health")
    async def health(request: Request) -> Response:
        for route in _state(request).routes:
            if not route.pool.healthy():
                raise APIError(503, f"no healthy {route.role}", code="no_healthy_worker")
        return Response(status_code=200)

    @app.get("/workers")
    async def workers(request: Request) -> JSONResponse:
        state = _state(request)
        return JSONResponse({"policy": state.config.policy, "workers": [
            _worker_json(route, w) for route in state.routes for w in route.pool.workers]})


def _worker_json(route: Route, w) -> dict:
    blocks = getattr(route.policy, "blocks", {})
    return {"url": w.url, "role": route.role, "healthy": w.healthy, "load": w.load,
            "num_requests_total": w.num_requests_total,
            **({"num_cached_blocks": len(blocks[w.url].hashes)} if w.url in blocks else {})}
