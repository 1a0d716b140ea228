"""A `kvserve serve` subprocess on the tiny checkpoint for the bench serve/sweep tests, and small workloads
whose token ids come from the built-in `mixed` workload."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvserve.bench.workload import workload_path


@pytest.fixture(scope="module")
def base_url(tiny_llama, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("bench_server") / "server.log"
    cmd = [sys.executable, "-m", "kvserve.server.cli", "--model", tiny_llama[0], "--port", "0", "--num-threads", "1",
           "--kv-cache-memory", "16MiB", "--no-access-log", "--stats-interval", "0"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = None
        for _ in range(300):
            text = log_path.read_text(errors="replace")
            assert proc.poll() is None, text
            if url is None and "serving on " in text:
                url = text.split("serving on ", 1)[1].split()[0]
            if url is not None:
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def workload_like_mixed(path, lengths: list[tuple[int, int]]) -> str:
    """Requests with the given (prompt tokens, max_tokens), token ids taken from the real `mixed` workload."""
    with open(workload_path("mixed")) as f:
        ids = json.loads(f.readline())["prompt_token_ids"]
    with open(path, "w") as f:
        for i, (num_prompt, max_tokens) in enumerate(lengths):
            prompt = (ids * (num_prompt // len(ids) + 1))[i:i + num_prompt]
            f.write(json.dumps({"id": str(i), "prompt_token_ids": prompt, "max_tokens": max_tokens,
                                "ignore_eos": True, "arrival_s": 0.0}) + "\n")
    return str(path)
