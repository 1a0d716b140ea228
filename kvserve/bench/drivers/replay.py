"""What the in-process peer drivers share: read a workload, time each request's tokens, write the results.

The drivers run inside a peer's own virtual environment, where kvserve is not installed, so this module
uses the standard library only. A driver is started as `python DRIVER.py ARGS_JSON`; it writes one JSON
object to its stdout's last line: {"duration_s": float, "results": [RequestTiming as dict, ...]}, the same
per-request fields `kvserve bench serve` measures over HTTP, so both are summarised by one function.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time


@dataclasses.dataclass
class RequestTiming:
    id: str
    prompt_tokens: int
    arrival_s: float                # when the request arrives, seconds after the start
    token_times: list = dataclasses.field(default_factory=list)   # seconds after the start, one per token
    token_ids: list = dataclasses.field(default_factory=list)
    error: str | None = None

    def as_result(self) -> dict:
        ok = bool(self.token_times) and self.error is None
        times = self.token_times
        return {"ok": ok, "id": self.id, "prompt_tokens": self.prompt_tokens, "output_tokens": len(times),
                "ttft_s": times[0] - self.arrival_s if ok else 0.0,
                "latency_s": times[-1] - self.arrival_s if ok else 0.0,
                "itls_s": [b - a for a, b in zip(times, times[1:])], "token_ids": self.token_ids,
                "error": self.error if not ok else None}


def read_args() -> dict:
    with open(sys.argv[1], encoding="utf-8") as f:
        return json.load(f)


def load_requests(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    return sorted(items, key=lambda r: float(r.get("arrival_s", 0.0)))


class Clock:
    """Seconds since the replay started."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


def write_results(timings: list[RequestTiming], duration_s: float) -> None:
    print(json.dumps({"duration_s": duration_s, "results": [t.as_result() for t in timings]}))
