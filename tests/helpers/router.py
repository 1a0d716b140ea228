"""`kvserve router` (and `kvserve proxy`) in a subprocess for tests (tests/e2e/test_router.py, test_proxy.py), as
tests/helpers/server.py starts `kvserve serve`: on a free port, returning once it announces where it routes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.helpers.server import Server, start_server, stop_server


@dataclass
class Router:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.base_url}/workers", timeout=10).json()["workers"]

    def stop(self) -> int:
        """SIGTERM, then the exit status (as stop_server does for `kvserve serve`)."""
        return stop_server(self)


def start_router(worker_urls: list[str], log_path: Path, *flags: str, timeout: float = 60.0) -> Router:
    return start_routing(["router", *[a for url in worker_urls for a in ("--worker", url)], *flags], log_path,
                         timeout=timeout)


def start_routing(args: list[str], log_path: Path, timeout: float = 60.0) -> Router:
    """`kvserve ARGS --port 0` (router, or proxy: tests/helpers/pd.py) once it announces where it listens."""
    cmd = [sys.executable, "-m", "kvserve.cli.main", *args, "--port", "0"]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}:\n{log_path.read_text()}")
        text = log_path.read_text(errors="replace")
        # NOTE: the CLI's own line: a log line about routing "on the prompts' text" must not match
        if "kvserve: routing on " in text:
            return Router(proc, text.split("kvserve: routing on ", 1)[1].split()[0], log_path)
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"router not ready after {timeout}s:\n{log_path.read_text()}")


def start_workers(model: str, log_dir: Path, n: int, *flags: str, timeout: float = 120.0) -> list[Server]:
    """n `kvserve serve` of one model, started at once (each logs to log_dir/w<i>.log)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: start_server(model, log_dir / f"w{i}.log", *flags, timeout=timeout), range(n)))


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s: {what}")


def scripted_stream(text: str, request: httpx.Request, cut: bool = False) -> httpx.Response:
    """A scripted worker's streamed answer (tests/server/test_router_app.py, test_pd_app.py): one event with
    `text`, then `[DONE]`, or (cut) the connection reset after the event."""
    async def events():
        yield f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode()
        if cut:
            raise httpx.ReadError("connection reset", request=request)
        yield b"data: [DONE]\n\n"
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())
