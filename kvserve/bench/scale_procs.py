"""The processes of `kvserve bench scale`: `kvserve serve` instances pinned to cores, `kvserve router` and
`kvserve proxy` in front of them, each on a free port, all stopped when the Fleet closes; and the streamed
requests the sections time.

Pinning: a process started with `cores` runs on those CPUs only (os.sched_setaffinity before exec), and so does
everything it starts (the engine process, its threads).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from kvserve.bench.startup import _stop, _wait_healthy

_ANNOUNCE = re.compile(r"^kvserve: (?:serving|routing) on (http://\S+)", re.MULTILINE)


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    url: str
    log: str


@dataclass
class Fleet:
    """Every process the bench started, in one folder of logs; closing it stops them all."""

    log_dir: str
    procs: list[Proc] = field(default_factory=list)
    timeout_s: float = 300.0

    def start(self, name: str, args: list[str], cores: set[int] | None = None) -> Proc:
        """`kvserve ARGS --host 127.0.0.1 --port 0`, once it answers /health."""
        log = os.path.join(self.log_dir, f"{name}.log")
        cmd = [sys.executable, "-m", "kvserve.cli.main", *args, "--host", "127.0.0.1", "--port", "0"]
        pin = None if cores is None else (lambda: os.sched_setaffinity(0, cores))
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=pin, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + self.timeout_s
        try:
            url = _announced(proc, log, deadline)
            _wait_healthy(proc, url, deadline)
        except RuntimeError as e:
            _stop(proc)
            raise RuntimeError(f"{name}: {e}; its log: {log}") from None
        self.procs.append(Proc(name, proc, url, log))
        return self.procs[-1]

    def serve(self, name: str, flags: list[str], cores: set[int] | None = None) -> Proc:
        """`kvserve serve FLAGS`, warmed up by one short request (what a first request pays once is not measured)."""
        item = self.start(name, ["serve", *flags], cores)
        body = {"prompt": list(range(1000, 1040)), "max_tokens": 2, "temperature": 0.0}
        httpx.post(f"{item.url}/v1/completions", json=body, timeout=self.timeout_s).raise_for_status()
        return item

    def stop(self, item: Proc) -> None:
        _stop(item.proc)
        self.procs.remove(item)

    def close(self) -> None:
        for item in reversed(list(self.procs)):
            self.stop(item)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _announced(proc: subprocess.Popen, log: str, deadline: float) -> str:
    while time.monotonic() < deadline:
        with open(log, encoding="utf-8", errors="replace") as f:
            found = _ANNOUNCE.search(f.read())
        if found:
            return found.group(1).rstrip("/")
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before announcing its address")
        time.sleep(0.05)
    raise RuntimeError("did not announce its address in time")


def command_exists(*words: str) -> str | None:
    """None when `kvserve WORDS --help` works, else why not (its last line of output)."""
    done = subprocess.run([sys.executable, "-m", "kvserve.cli.main", *words, "--help"], capture_output=True,
                          text=True, timeout=120)
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def max_model_len(url: str) -> int:
    return int(httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["max_model_len"])


def scrape(url: str) -> dict[str, float]:
    """Every sample of a server's /metrics, summed over labels, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


@dataclass
class Timing:
    ok: bool
    ttft_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    error: str | None = None
    cached_tokens: int | None = None
    """The prompt tokens the server did not compute (its prefix cache, or a KV connector's load), from usage."""


async def stream(client: httpx.AsyncClient, path: str, body: dict) -> Timing:
    """POST a streamed completion or chat; time its first token and the gaps between the next ones."""
    body = {**body, "stream": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    result = Timing(ok=False)
    num = 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                data = line[len("data:"):].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                # NOTE: a chat stream opens with a role-only delta before any token: not a token
                if chunk.get("choices") and "role" not in (chunk["choices"][0].get("delta") or {}):
                    now = time.perf_counter()
                    if num == 0:
                        result.ttft_s = now - start
                    else:
                        result.itls_s.append(now - last)
                    last, num = now, num + 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.ok = num > 0
    result.error = None if result.ok else "no tokens streamed"
    return result
