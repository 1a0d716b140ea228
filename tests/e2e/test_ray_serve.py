"""`python -m kvserve.serve_ray` (skipped without Ray Serve): two kvserve replicas behind Ray Serve's router on a
local Ray instance answer completions and chats, streamed or not, token for token as one kvserve server does;
SIGTERM ends the application and the Ray instance it started. Flags reach each replica as `kvserve serve`'s."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("ray.serve")

from kvserve.serve_ray import _argv, _strip_own, build_app  # noqa: E402
from tests.helpers.server import DEFAULT_FLAGS, in_process, sse_events  # noqa: E402

pytestmark = pytest.mark.ray
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def _requests() -> list[tuple[str, dict]]:
    out = []
    for r in range(8):
        out.append(("/v1/completions", {"prompt": " ".join(WORDS[r:] + WORDS[:r]), "max_tokens": 6,
                                        "temperature": 0, "stream": r % 2 == 0}))
    for r in range(4):
        out.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": f"tell me about {WORDS[r]}"}],
                                             "max_tokens": 6, "temperature": 0, "stream": r % 2 == 1}))
    return out


def _text(http: httpx.Client, path: str, body: dict) -> str:
    if body.get("stream"):
        with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            chunks = [c["choices"][0] for c in sse_events(r) if c.get("choices")]
        return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in chunks)
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _answers(http: httpx.Client) -> list[str]:
    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(lambda item: _text(http, *item), _requests()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_run_arguments_become_serve_flags():
    assert _argv({"model": "m", "num_replicas": "2", "enable_prefix_caching": "false", "trust": True}) == [
        "--model", "m", "--num-replicas", "2", "--no-enable-prefix-caching", "--trust"]
    assert _strip_own(["--num-replicas", "2", "--model", "m", "--num-cpus-per-replica=0.5"]) == ["--model", "m"]
    with pytest.raises(ValueError, match="block_size|block size"):
        build_app({"model": "m", "block_size": "0"})
    with pytest.raises(ValueError, match="num-replicas"):
        build_app(["--model", "m", "--num-replicas", "0"])


def test_two_ray_serve_replicas_answer_as_one_server(tiny_llama, tmp_path):
    model = tiny_llama[0]
    port = _free_port()
    log_path = tmp_path / "serve_ray.log"
    cmd = [sys.executable, "-m", "kvserve.serve_ray", "--num-replicas", "2", "--model", model, "--port", str(port),
           *DEFAULT_FLAGS]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300
        while "serving on" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.5)
        assert "2 replica(s) RUNNING" in log_path.read_text()
        gen = in_process(model)
        reference_server = next(gen)
        try:
            with reference_server.http() as http:
                reference = _answers(http)
        finally:
            gen.close()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            assert http.get("/health").status_code == 200
            assert _answers(http) == reference
            assert http.get("/v1/models").json()["data"][0]["id"] == model
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log_path.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
