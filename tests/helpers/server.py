"""The HTTP server for tests, two ways, driven by the same clients:

- `AppServer`: `kvserve serve FLAGS` in this process: the app `build_app` makes from the CLI's own parsing of
  FLAGS, its event loop on a thread of its own (as uvicorn runs it) and the engine loop on another thread
  (`--engine-loop thread`). Clients reach it through an httpx transport that speaks ASGI to the app, with
  no socket: bodies stream piece by piece, a client that closes a response or times out disconnects (the
  app's `receive()` answers `http.disconnect`, as uvicorn's does), and an app exception is logged and
  answered 500, as uvicorn does. What the server tier (tests/server/) uses.
- `Server`: `kvserve serve --port 0 FLAGS` in a subprocess (with its engine in a child process by default),
  for what needs a real process: signals, uvicorn's own HTTP parsing, engine death (tests/e2e/).

Both have `http()`, `async_http()`, `openai()`, `async_openai()`, `anthropic()` and `log()`. Also here:
the /metrics reader, the idle wait, SSE parsing, and OpenAI's OpenAPI schemas (`check_schema`), which
the repository does not ship: see `OpenAISchemas`. Registered as a pytest plugin (its fixtures and hook)
by `pytest_plugins = ["tests.helpers.server"]` in tests/conftest.py.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import httpx
import httpx2
import pytest
import requests
import requests.adapters
import urllib3

API_KEY = "sk-test-key"
# What every test server runs with unless a test's flags say otherwise.
DEFAULT_FLAGS = ("--num-threads", "1", "--kv-cache-memory", "32MiB", "--no-access-log")
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the CLI's (kvserve.server.cli.main)


# ---- clients, whichever way the server runs ---------------------------------------------------
class _Clients:
    """Clients of a server: httpx, `openai` and `anthropic`, with the test API key unless told otherwise."""

    base_url: str

    def transport(self, lib=httpx):
        """The transport of `lib`'s clients (httpx, or httpx2 for the SDKs); None: a real socket."""
        return None

    def async_transport(self, lib=httpx):
        return None

    def http(self, headers: dict | None = None, timeout: float | httpx.Timeout = 60, **kwargs) -> httpx.Client:
        """An httpx client (use as a context manager); headers default to `Authorization: Bearer API_KEY`."""
        headers = {"Authorization": f"Bearer {API_KEY}"} if headers is None else headers
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=self.transport(),
                            **kwargs)

    def async_http(self, headers: dict | None = None, timeout: float | httpx.Timeout = 60,
                   **kwargs) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {API_KEY}"} if headers is None else headers
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout,
                                 transport=self.async_transport(), **kwargs)

    def request(self, method: str, path: str, headers: dict | None = None, **kwargs) -> httpx.Response:
        """One request on a client of its own, with no API key unless `headers` carry one."""
        with self.http(headers=headers or {}) as client:
            return client.request(method, path, **kwargs)

    def openai(self, api_key: str = API_KEY, timeout: float = 60):
        """The `openai` client, no retries."""
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout,
                             **self._sdk_http_client(timeout))

    def async_openai(self, api_key: str = API_KEY, timeout: float = 60):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout,
                                  **self._sdk_http_client(timeout, asynchronous=True))

    def anthropic(self, api_key: str = API_KEY, timeout: float = 60):
        """The `anthropic` client, no retries."""
        import anthropic

        return anthropic.Anthropic(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=timeout,
                                   **self._sdk_http_client(timeout))

    def requests_session(self) -> requests.Session:
        """A `requests` session that reaches the server (schemathesis sends its cases with `requests`)."""
        return requests.Session()

    def _sdk_http_client(self, timeout: float, asynchronous: bool = False) -> dict:
        """The SDKs' own httpx2 client over a real socket (no argument); over our transport to reach an
        in-process app."""
        transport = (self.async_transport if asynchronous else self.transport)(httpx2)
        if transport is None:
            return {}
        client = httpx2.AsyncClient if asynchronous else httpx2.Client
        return {"http_client": client(transport=transport, timeout=timeout)}


def parse_serve_flags(model: str | None, *flags: str):
    """(ServerConfig, EngineArgs) of `kvserve serve [--model MODEL] FLAGS`, parsed as the CLI parses them."""
    from kvserve.config import EngineArgs
    from kvserve.server.cli import add_arguments
    from kvserve.server.config import ServerConfig

    parser = argparse.ArgumentParser(prog="kvserve serve")
    add_arguments(parser)
    args = parser.parse_args([*(["--model", model] if model else []), *flags])
    return ServerConfig.from_cli(args), EngineArgs.from_cli(args)


# ---- the app in this process ------------------------------------------------------------------
class AppServer(_Clients):
    """`kvserve serve [--model MODEL] DEFAULT_FLAGS FLAGS` in this process, with the engine loop on a thread.

    `start()` returns once the app's lifespan has started the engine (as /health would answer 200);
    `stop()` runs the lifespan's shutdown (the engine stops) and raises if it fails. `env`: environment
    variables set while the app is built and started (e.g. KVSERVE_API_KEY)."""

    base_url = "http://kvserve.test"  # only a name: nothing listens

    def __init__(self, model: str | None, *flags: str, env: dict[str, str] | None = None):
        self.config, self.engine_args = parse_serve_flags(model, *DEFAULT_FLAGS, "--engine-loop", "thread",
                                                          *flags)
        self.env = env or {}
        self._log = io.StringIO()
        self._log_handler = logging.StreamHandler(self._log)
        self._log_handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def app(self):
        return self._app

    def log(self) -> str:
        """What the server logged so far (every logger of this process while it runs, in the CLI's format)."""
        self._log_handler.flush()
        return self._log.getvalue()

    def start(self, timeout: float = 120.0) -> "AppServer":
        import torch

        from kvserve.server.api_server import build_app

        self._restore = {"threads": torch.get_num_threads(), "level": logging.getLogger("kvserve").level}
        logging.getLogger().addHandler(self._log_handler)
        logging.getLogger("kvserve").setLevel(logging.INFO)  # as the CLI's logging.basicConfig(level=INFO)
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            self._app = build_app(self.config, self.engine_args, on_engine_dead=self._on_engine_dead)
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="kvserve-test-app", daemon=True)
            self._thread.start()
            self._lifespan = _Lifespan(self._app)
            self.call(self._lifespan.startup(), timeout)
        except BaseException as e:
            self._close()
            raise RuntimeError(f"the server did not start: {e}\n{self.log()}") from e
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Shut down as SIGTERM would once requests have finished: the lifespan's shutdown, which must succeed."""
        try:
            self.call(self._lifespan.shutdown(), timeout)
        finally:
            self._close()

    def _close(self) -> None:
        import torch

        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self.call(_cancel_other_tasks(), 10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
        logging.getLogger().removeHandler(self._log_handler)
        logging.getLogger("kvserve").setLevel(self._restore["level"])
        torch.set_num_threads(self._restore["threads"])  # --num-threads set it for the whole process

    def _on_engine_dead(self, reason: str) -> None:
        logging.getLogger("kvserve.server").error("shutting down: %s", reason)  # as the CLI does

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the app's event loop; its result (from any thread but that loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def acall(self, coro):
        """Await a coroutine on the app's event loop from another event loop."""
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def leave(self, exchange: "_Exchange") -> None:
        """The client of `exchange` closed its connection (a no-op once the server has stopped)."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(exchange.leave)

    def transport(self, lib=httpx):
        return _transports(lib)[0](self)

    def async_transport(self, lib=httpx):
        return _transports(lib)[1](self)

    def requests_session(self) -> requests.Session:
        session = super().requests_session()
        session.mount(self.base_url, _RequestsAdapter(self))
        return session


async def _cancel_other_tasks() -> None:
    """Requests still in flight when the server stops (a client that never read its stream) are cancelled,
    as uvicorn cancels them past its graceful shutdown."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _Lifespan:
    """The ASGI lifespan protocol, as uvicorn drives it: startup before any request, shutdown after."""

    def __init__(self, app):
        self.app = app

    async def startup(self) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.outbox: asyncio.Queue = asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self.task = asyncio.ensure_future(self.app(scope, self.inbox.get, self.outbox.put))
        await self._exchange("startup")

    async def shutdown(self) -> None:
        await self._exchange("shutdown")
        await self.task

    async def _exchange(self, phase: str) -> None:
        await self.inbox.put({"type": f"lifespan.{phase}"})
        answer = asyncio.ensure_future(self.outbox.get())
        await asyncio.wait({answer, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():
            answer.cancel()
            self.task.result()  # raises what ended the lifespan
            raise RuntimeError(f"the app's lifespan ended during {phase}")
        message = answer.result()
        if message["type"] != f"lifespan.{phase}.complete":
            raise RuntimeError(f"lifespan {phase} failed: {message.get('message', '')}")


_uvicorn_logger = logging.getLogger("uvicorn.error")
_CUT_SHORT = object()


class _Exchange:
    """One request and its response on a connection, on the app's side (runs on the app's event loop), with
    uvicorn's semantics: `receive()` gives the body as it came, then waits until the response is complete or
    the client has gone, and answers `http.disconnect`; what the app sends after the client has gone is
    dropped; an exception before the response starts is a 500, one after it cuts the body short."""

    def __init__(self, app, scope: dict, chunks: list[bytes]):
        self.chunks = deque(chunks or [b""])
        self.started: asyncio.Future = asyncio.get_running_loop().create_future()
        self.body: asyncio.Queue = asyncio.Queue()  # bytes; None at the end; _CUT_SHORT if cut short
        self.wake = asyncio.Event()
        self.disconnected = self.complete = False
        self.task = asyncio.ensure_future(self._run(app, scope))

    @classmethod
    async def open(cls, app, scope: dict, chunks: list[bytes]) -> "_Exchange":
        return cls(app, scope, chunks)

    async def receive(self) -> dict:
        if self.chunks and not self.disconnected:
            body = self.chunks.popleft()
            return {"type": "http.request", "body": body, "more_body": bool(self.chunks)}
        if not (self.disconnected or self.complete):
            await self.wake.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if self.disconnected:
            return
        if message["type"] == "http.response.start":
            self.started.set_result((message["status"], message.get("headers", [])))
        elif message["type"] == "http.response.body":
            if message.get("body"):
                self.body.put_nowait(bytes(message["body"]))
            if not message.get("more_body", False):
                self.complete = True
                self.body.put_nowait(None)
                self.wake.set()

    async def _run(self, app, scope: dict) -> None:
        try:
            await app(scope, self.receive, self.send)
        except asyncio.CancelledError:  # the server stopped with this request in flight
            self._fail()
            raise
        except BaseException as e:
            _uvicorn_logger.error("Exception in ASGI application\n", exc_info=e)
            self._fail()
        else:
            if not self.started.done() and not self.disconnected:
                _uvicorn_logger.error("ASGI callable returned without starting response.")
                self._fail()
            elif not self.complete and not self.disconnected:
                _uvicorn_logger.error("ASGI callable returned without completing response.")
                self._fail()

    def _fail(self) -> None:
        if not self.started.done():
            self.started.set_result((500, [(b"content-type", b"text/plain; charset=utf-8")]))
            self.body.put_nowait(b"Internal Server Error")
            self.body.put_nowait(None)
        elif not self.complete:  # uvicorn closes the connection: the body ends short
            self.body.put_nowait(_CUT_SHORT)
        self.complete = True
        self.wake.set()

    async def response_start(self, timeout: float | None) -> tuple[int, list]:
        try:
            return await asyncio.wait_for(asyncio.shield(self.started), timeout)
        except TimeoutError:
            self.leave()
            raise

    async def next_body(self, timeout: float | None):
        try:
            return await asyncio.wait_for(self.body.get(), timeout)
        except TimeoutError:
            self.leave()
            raise

    def leave(self) -> None:
        """The client closed the connection."""
        if not self.complete:
            self.disconnected = True
            self.wake.set()


@functools.cache
def _transports(lib):
    """The (sync, async) transport classes to the app for httpx or httpx2 (the SDKs' fork of it, whose
    clients take only its own classes): the same code over either module's types."""
    def timed_out(request):
        return lib.ReadTimeout("timed out", request=request)

    def read_timeout(request) -> float | None:
        return request.extensions.get("timeout", {}).get("read")

    def scope(request) -> dict:
        url = request.url
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "server": (url.host, url.port or 80), "client": ("127.0.0.1", 50000), "scheme": url.scheme,
                "root_path": "", "method": request.method, "path": unquote(url.path),
                "raw_path": url.raw_path.split(b"?", 1)[0], "query_string": url.query,
                "headers": [(k.lower(), v) for k, v in request.headers.raw], "state": {}}

    def chunk_or_raise(chunk, request):
        if chunk is _CUT_SHORT:  # uvicorn closed the connection mid-body
            raise lib.RemoteProtocolError("peer closed connection without sending complete message body",
                                          request=request)
        return chunk

    class Body(lib.SyncByteStream):
        def __init__(self, server: AppServer, exchange: _Exchange, request, read: float | None):
            self.server, self.exchange, self.request, self.read = server, exchange, request, read

        def __iter__(self) -> Iterator[bytes]:
            while True:
                try:
                    chunk = self.server.call(self.exchange.next_body(self.read))
                except TimeoutError:
                    raise timed_out(self.request) from None
                if chunk is None:
                    return
                yield chunk_or_raise(chunk, self.request)

        def close(self) -> None:
            self.server.leave(self.exchange)

    class Transport(lib.BaseTransport):
        """A client -> the app, from any thread but the app's; see _Exchange."""

        def __init__(self, server: AppServer):
            self.server = server

        def handle_request(self, request):
            read = read_timeout(request)
            exchange = self.server.call(_Exchange.open(self.server.app, scope(request), list(request.stream)))
            try:
                status, headers = self.server.call(exchange.response_start(read))
            except TimeoutError:
                raise timed_out(request) from None
            return lib.Response(status, headers=headers, stream=Body(self.server, exchange, request, read),
                                request=request)

    class AsyncBody(lib.AsyncByteStream):
        def __init__(self, server: AppServer, exchange: _Exchange, request, read: float | None):
            self.server, self.exchange, self.request, self.read = server, exchange, request, read

        async def __aiter__(self):
            while True:
                try:
                    chunk = await self.server.acall(self.exchange.next_body(self.read))
                except TimeoutError:
                    raise timed_out(self.request) from None
                if chunk is None:
                    return
                yield chunk_or_raise(chunk, self.request)

        async def aclose(self) -> None:
            self.server.leave(self.exchange)

    class AsyncTransport(lib.AsyncBaseTransport):
        """An async client, on an event loop of its own -> the app; see _Exchange."""

        def __init__(self, server: AppServer):
            self.server = server

        async def handle_async_request(self, request):
            read = read_timeout(request)
            chunks = [chunk async for chunk in request.stream]
            exchange = await self.server.acall(_Exchange.open(self.server.app, scope(request), chunks))
            try:
                status, headers = await self.server.acall(exchange.response_start(read))
            except TimeoutError:
                raise timed_out(request) from None
            return lib.Response(status, headers=headers, stream=AsyncBody(self.server, exchange, request, read),
                                request=request)

    return Transport, AsyncTransport


class _RequestsAdapter(requests.adapters.HTTPAdapter):
    """`requests` -> the app: the prepared request (its bytes as `requests` encoded them) goes through the
    httpx transport; the response comes back as urllib3's, read as it streams (closing it disconnects)."""

    def __init__(self, server: AppServer):
        super().__init__()
        self.server = server

    def send(self, request, stream=False, timeout=None, verify=True, cert=None, proxies=None):
        read = timeout[1] if isinstance(timeout, tuple) else timeout
        body = request.body.encode() if isinstance(request.body, str) else request.body
        outgoing = httpx.Request(request.method, request.url, headers=list(request.headers.items()), content=body,
                                 extensions={"timeout": {"connect": read, "read": read, "write": read,
                                                         "pool": read}})
        try:
            response = self.server.transport().handle_request(outgoing)
        except httpx.ReadTimeout as e:
            raise requests.exceptions.ReadTimeout(e, request=request) from None
        raw = urllib3.HTTPResponse(body=io.BufferedReader(_RawStream(response)),
                                   headers=urllib3.HTTPHeaderDict(response.headers.multi_items()),
                                   status=response.status_code, reason=response.reason_phrase, version=11,
                                   version_string="HTTP/1.1", preload_content=False, decode_content=False,
                                   request_method=request.method, request_url=request.url)
        built = self.build_response(request, raw)
        if not stream:
            built.content  # noqa: B018  (read now, as requests does without stream=True)
        return built


class _RawStream(io.RawIOBase):
    """An httpx response's body as a file (what urllib3 reads from a socket)."""

    def __init__(self, response: httpx.Response):
        self.response, self.chunks, self.pending = response, response.iter_raw(), b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.pending:
            self.pending = next(self.chunks, b"")
            if not self.pending:
                return 0
        n = min(len(buffer), len(self.pending))
        buffer[:n], self.pending = self.pending[:n], self.pending[n:]
        return n

    def close(self) -> None:
        self.response.close()
        super().close()


def in_process(model: str | None, *flags: str, env: dict[str, str] | None = None) -> Iterator[AppServer]:
    """Module-fixture body: an in-process server with API_KEY for the module's tests (yields it; stops it)."""
    srv = AppServer(model, "--api-key", API_KEY, *flags, env=env).start()
    try:
        yield srv
    finally:
        srv.stop()


# ---- the server in a subprocess ---------------------------------------------------------------
@dataclass
class Server(_Clients):
    """A `kvserve serve` process; base_url is where it listens."""

    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(model: str | None, log_path: Path, *flags: str, timeout: float = 60.0) -> Server:
    """`kvserve serve --port 0 ...` in a subprocess; returns once /health answers 200. model None: no --model
    (the built-in model, under its own name)."""
    cmd = [sys.executable, "-m", "kvserve.server.cli", *(["--model", model] if model else []), "--port", "0",
           *DEFAULT_FLAGS, *flags]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    base_url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        text = log_path.read_text(errors="replace")
        if base_url is None and "serving on " in text:
            base_url = text.split("serving on ", 1)[1].split()[0]
        if base_url is not None:
            try:
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    return Server(proc, base_url, log_path)
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server not ready after {timeout}s:\n{log_path.read_text()}")


def stop_server(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
    return server.proc.wait()


def served(model: str, tmp_path_factory, *flags: str) -> Iterator[Server]:
    """Module-fixture body: a subprocess server with API_KEY for the module's tests; it must then exit 0 on
    SIGTERM."""
    srv = start_server(model, tmp_path_factory.mktemp("server") / "server.log", "--api-key", API_KEY, *flags)
    yield srv
    assert stop_server(srv) == 0, srv.log()


# ---- /metrics, idleness, SSE ------------------------------------------------------------------
def metric(http: httpx.Client, name: str, **labels) -> float:
    """The value of one sample of /metrics (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


_IDLE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_request_blocks")


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> None:
    """No request running or waiting and no KV block held by one. Blocks pinned by prompt caching
    (cache_control) stay held for their TTL by design, so the pool's usage need not return to 0: a fuzzed
    Anthropic body with a cache_control block long enough to pin kept kv_cache_usage_perc above 0 for minutes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(metric(http, f"kvserve:{name}") == 0 for name in _IDLE_GAUGES):
            return
        time.sleep(0.05)
    gauges = {name: metric(http, f"kvserve:{name}") for name in (*_IDLE_GAUGES, "kv_cache_usage_perc",
                                                                 "prefix_cache_pinned_blocks")}
    raise AssertionError(f"server not idle after {timeout}s: {gauges}")


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of an SSE body; asserts it ends with `data: [DONE]`."""
    payloads = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    return [json.loads(p) for p in payloads[:-1]]


# ---- OpenAI's schemas -------------------------------------------------------------------------
SPEC_ENV = "KVSERVE_OPENAPI_SPEC"
DEFAULT_SPEC = Path(__file__).resolve().parents[2].parent / "shared" / "specs" / "openai-openapi.yml"


def openai_spec_path() -> tuple[Path | None, str]:
    """(the OpenAI OpenAPI document's path, "") when there is one, else (None, why not). $KVSERVE_OPENAPI_SPEC
    if set, else ../shared/specs/openai-openapi.yml beside the repository; the repository does not ship it."""
    configured = os.environ.get(SPEC_ENV)
    path = Path(configured) if configured else DEFAULT_SPEC
    if path.is_file():
        return path, ""
    where = f"{SPEC_ENV}={configured} is not a file" if configured else f"{SPEC_ENV} is unset and {DEFAULT_SPEC} absent"
    return None, (f"OpenAI's OpenAPI document is not here ({where}); the repository does not ship it: put "
                  f"openai-openapi.yml there or point {SPEC_ENV} at it")


def _openapi_to_jsonschema(node) -> None:
    """OpenAPI 3.0's `nullable: true` (still used in places of this 3.1 document) -> JSON Schema."""
    if isinstance(node, list):
        for item in node:
            _openapi_to_jsonschema(item)
        return
    if not isinstance(node, dict):
        return
    for value in node.values():
        _openapi_to_jsonschema(value)
    if node.pop("nullable", False):
        if isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
            if "enum" in node:
                node["enum"] = [*node["enum"], None]
        else:
            inner = dict(node)
            node.clear()
            node["anyOf"] = [inner, {"type": "null"}]


@functools.cache
def _load_document(path: Path) -> dict:
    import yaml

    spec = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    _openapi_to_jsonschema(spec)
    schemas = spec["components"]["schemas"]
    # NOTE: the spec uses one schema for completion bodies and stream chunks, but a chunk of a choice that
    # is still running carries finish_reason null (as OpenAI's API sends it); allow that for chunks only.
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {
        "anyOf": [chunk["properties"]["choices"]["items"]["properties"]["finish_reason"], {"type": "null"}]}
    schemas["CreateCompletionStreamChunk"] = chunk
    return spec


class OpenAISchemas:
    """Validators of OpenAI's component schemas (from its OpenAPI document, with `nullable` converted and a
    CreateCompletionStreamChunk added), or, without the document, the reason there are none."""

    def __init__(self, patch=None):
        """patch(schemas): changes a copy of the document's component schemas (a test's own variant)."""
        path, self.missing = openai_spec_path()
        self._registry = None
        self._validators: dict = {}
        if path is None:
            return
        import referencing
        import referencing.jsonschema

        spec = _load_document(path)
        if patch is not None:
            spec = copy.deepcopy(spec)
            patch(spec["components"]["schemas"])
        resource = referencing.Resource.from_contents(spec, default_specification=referencing.jsonschema.DRAFT202012)
        self._registry = referencing.Registry().with_resource("openai.yml", resource)

    @property
    def available(self) -> bool:
        return self._registry is not None

    def validate(self, name: str, instance) -> None:
        import jsonschema

        if name not in self._validators:
            self._validators[name] = jsonschema.Draft202012Validator(
                {"$ref": f"openai.yml#/components/schemas/{name}"}, registry=self._registry)
        self._validators[name].validate(instance)

    def checker(self, node: pytest.Item) -> "SchemaChecker":
        return SchemaChecker(self, node)


_NOT_CHECKED = pytest.StashKey[list]()


class SchemaChecker:
    """check(name, instance) raises jsonschema.ValidationError unless `instance` matches OpenAI's component
    schema `name`. Without the document the check is recorded as not done, and the test, once everything
    else in it has passed, is reported skipped with the reason (see pytest_runtest_call)."""

    def __init__(self, schemas: OpenAISchemas, node: pytest.Item):
        self.schemas, self.node = schemas, node

    def __call__(self, name: str, instance) -> None:
        if self._available(name):
            self.schemas.validate(name, instance)

    def rejects(self, name: str, instance) -> None:
        """Asserts that `instance` does NOT match schema `name`."""
        import jsonschema

        if self._available(name):
            with pytest.raises(jsonschema.ValidationError):
                self.schemas.validate(name, instance)

    def _available(self, name: str) -> bool:
        if self.schemas.available:
            return True
        self.node.stash.setdefault(_NOT_CHECKED, []).append(name)
        return False


@pytest.fixture(scope="session")
def openai_schemas() -> OpenAISchemas:
    return OpenAISchemas()


@pytest.fixture
def check_schema(openai_schemas, request) -> SchemaChecker:
    """check_schema(component_name, instance) raises jsonschema.ValidationError on a mismatch."""
    return openai_schemas.checker(request.node)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield  # NOTE: a test that failed raises here, and is reported failed
    not_checked = item.stash.get(_NOT_CHECKED, None)
    if not_checked:
        pytest.skip(f"{len(not_checked)} schema check(s) not done ({', '.join(sorted(set(not_checked)))}), "
                    f"everything else passed: {openai_spec_path()[1]}")
    return result
