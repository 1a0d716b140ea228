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
the /metrics reader, the idle wait and SSE parsing. The ASGI transport is tests/helpers/asgi.py; OpenAI's
OpenAPI schemas (`check_schema`) are tests/helpers/openai_schemas.py.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import httpx2
import requests
import requests.adapters

from tests.helpers.asgi import _Exchange, _Lifespan, _RequestsAdapter, _transports

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
