"""An httpx (and httpx2, and requests) transport that speaks ASGI to an app in this process, with uvicorn's
semantics: the lifespan run before any request and after the last, bodies streamed piece by piece, a client
that closes a response or times out disconnects (the app's `receive()` answers `http.disconnect`), and an
app exception logged and answered 500 (or a body cut short). Used by tests/helpers/server.py's AppServer."""
from __future__ import annotations

import asyncio
import functools
import io
import logging
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING
from urllib.parse import unquote

import httpx
import requests
import requests.adapters
import urllib3

if TYPE_CHECKING:
    from tests.helpers.server import AppServer


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
