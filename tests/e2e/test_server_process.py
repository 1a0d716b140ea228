"""`kvserve serve` as a real process (a subprocess on a free port, the engine in its own child process unless
told otherwise): what only a process shows. Signals (SIGTERM drains, then aborts past --shutdown-timeout),
uvicorn's own HTTP parsing (a malformed chunked body), the engine process dying, and the CLI refusing a
missing model. Everything else about the server runs in process: tests/server/.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from tests.helpers.server import API_KEY, Server, served, start_server, stop_server


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama[0], tmp_path_factory, "--stats-interval", "0")


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


# ---- uvicorn's HTTP parsing -------------------------------------------------------------------
def test_malformed_chunked_body_is_a_400_not_a_traceback(server, http, model):
    """A chunked body that is not chunked encoding: the HTTP parser answers 400 and closes mid-body, and
    the body reader takes that as an incomplete body (before: an unhandled ClientDisconnect, logged as an
    exception in the ASGI application)."""
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    seen = len(server.log())
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 400 ")
    assert http.post("/v1/completions", json={"model": model, "prompt": "ok", "max_tokens": 1}).status_code == 200
    new_log = server.log()[seen:]
    assert "Traceback" not in new_log and "Exception in ASGI application" not in new_log, new_log


# ---- the CLI ----------------------------------------------------------------------------------
def test_serve_with_a_missing_model_fails_before_announcing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvserve.cli.main", "serve", "--model", str(tmp_path / "nope"),
                           "--port", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "serving on" not in proc.stdout + proc.stderr
    assert "model not found" in proc.stderr


# ---- shutdown (the first with the engine loop on a thread: the other placement) ---------------
@contextlib.contextmanager
def _streaming(srv: Server, max_tokens: int) -> Iterator[Iterator[str]]:
    """A completion streaming from `srv`, its first event read: yields the iterator of the lines after it."""
    body = {"prompt": [7, 8, 9], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=srv.base_url, timeout=30) as c, c.stream("POST", "/v1/completions",
                                                                         json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        yield lines


def _data(lines: Iterator[str]) -> list[str]:
    """The rest of a stream's `data:` lines; asserts it ends with [DONE]."""
    rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    return rest


def _payload(line: str) -> dict:
    return json.loads(line[len("data: "):])


def test_sigterm_finishes_in_flight_requests_then_exits_0(tiny_llama, tmp_path):
    srv = start_server(tiny_llama[0], tmp_path / "server.log", "--engine-loop", "thread", "--shutdown-timeout", "20")
    try:
        with _streaming(srv, 300) as lines:
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.TransportError):  # no longer accepting connections
                httpx.get(f"{srv.base_url}/health", timeout=2)
            rest = _data(lines)
        assert _payload(rest[-2])["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(30) == 0, srv.log()
    finally:
        stop_server(srv)


def test_sigterm_past_shutdown_timeout_ends_streams_with_an_error_event(tiny_llama, tmp_path):
    srv = start_server(tiny_llama[0], tmp_path / "server.log", "--shutdown-timeout", "1")
    try:
        with _streaming(srv, 1000) as lines:
            start = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            rest = _data(lines)
            elapsed = time.monotonic() - start
        last = _payload(rest[-2])
        assert last["error"]["code"] == "shutting_down", last
        assert elapsed < 8
        assert srv.proc.wait(30) == 0, srv.log()
    finally:
        stop_server(srv)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_engine_process_death_fails_requests_and_exits_nonzero(tiny_llama, tmp_path):
    srv = start_server(tiny_llama[0], tmp_path / "server.log", "--stats-interval", "0")
    try:
        with _streaming(srv, 1000) as lines:
            engines = [p for p in _children(srv.proc.pid)
                       if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
            assert len(engines) == 1, engines
            start = time.monotonic()
            for pid in engines:
                os.kill(pid, signal.SIGKILL)
            rest = _data(lines)
            assert time.monotonic() - start < 5
        assert _payload(rest[-2])["error"]["type"] == "server_error"
        assert srv.proc.wait(30) == 1, srv.log()
        assert "engine loop stopped" in srv.log()
    finally:
        stop_server(srv)
