"""A stand-in for `kvserve serve` in router tests (tests/e2e/test_router_faults.py): a real HTTP server on a thread
of this process, so a `kvserve router` subprocess reaches it over a socket, and a test switches its health at
will without restarting anything (starting kvserve twice takes seconds).

    /health               200, or 503 (`health = "error"`), or no answer until switched back (`"hang"`)
    /v1/models            one model
    /v1/completions,
    /v1/chat/completions  after `delay_s`, an answer whose text is the worker's name (streamed if asked)
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass(eq=False)
class FakeWorker:
    name: str
    health: str = "ok"
    """ok | error | hang"""
    delay_s: float = 0.0
    num_completions: int = 0
    base_url: str = ""
    _server: uvicorn.Server | None = field(default=None, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            while self.health == "hang":  # answers only once switched back: the router's poll times out first
                await asyncio.sleep(0.05)
            return Response(status_code=503 if self.health == "error" else 200)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": "fake", "root": "/nowhere/fake"}]})

        async def complete(request: Request) -> Response:
            body = json.loads(await request.body())
            self.num_completions += 1
            await asyncio.sleep(self.delay_s)
            choice = {"index": 0, "text": self.name, "finish_reason": "length"}
            if not body.get("stream"):
                return JSONResponse({"object": "text_completion", "choices": [choice]})

            async def events():
                yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        app.post("/v1/completions")(complete)
        app.post("/v1/chat/completions")(complete)
        return app

    def start(self) -> FakeWorker:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app(), log_level="warning", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, f"fake worker {self.name} did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.health = "ok"  # ends hanging polls
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
