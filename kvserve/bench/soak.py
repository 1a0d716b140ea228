"""`kvserve bench soak`: drive a running server with random, partly hostile traffic for M minutes, then check it.

A fault soak, not a speed benchmark. --concurrency client tasks send requests back to back (soak_traffic.py:
random prompts and sampling parameters over /v1/completions, /v1/chat/completions and /v1/messages,
streamed and whole, shared prefixes and cache_control pins, about 5% invalid); about 20% of them hang up
early (a stream after k chunks, a whole answer after a random delay); now and then a burst of
--burst-size requests arrives at once, over the server's capacity.

Every answer is judged against its plan. Unexpected: any 5xx (Anthropic's 529 "overloaded" excepted),
an error body in the wrong shape (OpenAI's {"error": {...}}, or Anthropic's {"type": "error", ...} under
/v1/messages), a 200 stream without its terminator (`data: [DONE]`; `message_stop` or `error`) or with an
error inside it, a 4xx for a valid request (429 / 529 excepted) and a 2xx for an invalid one.

Once the traffic stops and the server is idle (running and waiting gauges at 0), the report adds: KV
blocks still held by requests (leaked), the resident-memory slope after warm-up in MB per 1,000
requests, new "Traceback" / "ERROR" lines of --log-file, and /health. Exit status 0 only when nothing
was unexpected, no block leaked and /health answered 200.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import time

import httpx

from kvserve.bench.soak_report import (
    RSS_METRICS,
    AfterTraffic,
    build_report,
    format_report,
    kv_blocks,
    memory_slopes,
    read_metrics,
    scan_log,
)
from kvserve.bench.soak_traffic import (
    ABORTED,
    COMPLETED,
    OVERLOADED,
    REJECTED,
    UNEXPECTED,
    WORDS,
    PlannedRequest,
    Result,
    ServerInfo,
    TrafficGenerator,
)
from kvserve.cli.standalone import standalone_main


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--minutes", type=float, required=True, help="how long to send traffic (e.g. 0.3)")
    parser.add_argument("--concurrency", type=int, default=32, help="client tasks sending back to back")
    parser.add_argument("--burst-size", type=int, default=128,
                        help="requests of each burst, sent at once; set it above the server's "
                             "max_num_seqs + max_queue_len")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random traffic")
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY` and `x-api-key`")
    parser.add_argument("--log-file", default=None,
                        help="the server's log: lines written during the soak are scanned for Traceback / ERROR "
                             "(default: none, no scan)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    parser.add_argument("--idle-timeout", type=float, default=60.0,
                        help="seconds to wait for the server to go idle after the traffic stops")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write every figure to this JSON file")


def run(args: argparse.Namespace) -> int:
    if not args.minutes > 0:
        raise ValueError(f"--minutes must be > 0, got {args.minutes}")
    if args.concurrency < 1 or args.burst_size < 0:
        raise ValueError("--concurrency must be >= 1 and --burst-size >= 0")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # NOTE: one INFO line per request otherwise
    report = asyncio.run(soak(args))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["passed"] else 1


# ---- one request ---------------------------------------------------------------------------------
async def send(client: httpx.AsyncClient, req: PlannedRequest) -> Result:
    """Send one planned request (hanging up where planned) and judge the answer."""
    headers = {"content-type": "application/json"}
    start = time.monotonic()
    try:
        if req.stream:
            async with client.stream("POST", req.endpoint, content=req.body, headers=headers) as response:
                if response.status_code != 200 or not req.valid:
                    return judge_whole(req, response.status_code, await response.aread())
                return await judge_stream(req, response)
        post = client.post(req.endpoint, content=req.body, headers=headers)
        try:
            response = await asyncio.wait_for(post, req.cancel_after_s)
        except asyncio.TimeoutError:
            return Result(req, ABORTED)
        return judge_whole(req, response.status_code, response.content)
    except httpx.TimeoutException as e:
        return Result(req, UNEXPECTED, problem=f"no answer within the client timeout ({type(e).__name__})")
    except httpx.HTTPError as e:
        return Result(req, UNEXPECTED, problem=f"transport error: {type(e).__name__}",
                      excerpt=f"after {time.monotonic() - start:.2f} s: {e!r}"[:300])


def judge_whole(req: PlannedRequest, status: int, body: bytes) -> Result:
    excerpt = body[:300].decode(errors="replace")
    if 200 <= status < 300:
        if not req.valid:
            return Result(req, UNEXPECTED, status, "2xx for an invalid request", excerpt)
        problem = _whole_body_problem(req, body)
        return Result(req, UNEXPECTED if problem else COMPLETED, status, problem, excerpt)
    if not _error_shape_ok(req, body):
        shape = "Anthropic" if req.anthropic else "OpenAI"
        return Result(req, UNEXPECTED, status, f"error body not in {shape} shape", excerpt)
    overloaded = 529 if req.anthropic else 429
    if status == overloaded:
        return Result(req, OVERLOADED, status, excerpt=excerpt)
    if status in (429, 529):
        return Result(req, UNEXPECTED, status, f"overload answered {status}, expected {overloaded}", excerpt)
    if 400 <= status < 500 and not req.valid:
        return Result(req, REJECTED, status, excerpt=excerpt)
    problem = "4xx for a valid request" if 400 <= status < 500 else f"HTTP {status}"
    return Result(req, UNEXPECTED, status, problem, excerpt)


def _whole_body_problem(req: PlannedRequest, body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except ValueError:
        return "200 body is not JSON"
    if req.anthropic:
        ok = isinstance(data, dict) and data.get("type") == "message" and isinstance(data.get("content"), list)
        return None if ok else "200 body is not a message"
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or len(choices) != req.num_choices:
        return f"200 body has {len(choices) if isinstance(choices, list) else 'no'} choices, expected {req.num_choices}"
    return None


def _error_shape_ok(req: PlannedRequest, body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return False
    if req.anthropic:
        return data.get("type") == "error" and isinstance(error.get("type"), str)
    return isinstance(error.get("type"), str)


async def judge_stream(req: PlannedRequest, response: httpx.Response) -> Result:
    """Read a 200 SSE stream (or hang up after `disconnect_after_chunks` data lines) and judge it."""
    num_data, event, terminated, problem, last = 0, None, False, None, ""
    async for line in response.aiter_lines():
        if req.disconnect_after_chunks is not None and num_data >= req.disconnect_after_chunks:
            return Result(req, ABORTED, 200)  # leaving `async with client.stream` closes the connection
        if line.startswith("event:"):
            event = line[6:].strip()
            continue
        if not line.startswith("data:"):
            continue
        num_data, data = num_data + 1, line[5:].strip()
        last = data[:300]
        if terminated and problem is None:
            problem = "data after the stream's terminator"
        if not req.anthropic and data == "[DONE]":
            terminated = True
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            problem = problem or "a stream chunk is not JSON"
            continue
        if req.anthropic and event in ("message_stop", "error"):
            terminated = True
        if event == "error" or (isinstance(chunk, dict) and "error" in chunk):
            problem = problem or "error event inside a 200 stream"
    if not terminated:
        problem = problem or ("stream ended without message_stop or error" if req.anthropic
                              else "stream ended without data: [DONE]")
    return Result(req, UNEXPECTED if problem else COMPLETED, 200, problem, last)


# ---- the server's side ---------------------------------------------------------------------------
async def server_info(client: httpx.AsyncClient) -> ServerInfo:
    try:
        models = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server: {e}") from None
    if models.status_code != 200:
        raise ValueError(f"GET /v1/models answered {models.status_code}: {models.text[:200]}")
    card = models.json()["data"][0]
    ids, per_word = list(range(1000, 20000)), 2.0  # NOTE: a server without /tokenize: plausible ids, a wide margin
    try:
        tokenized = await client.post("/tokenize", json={"model": card["id"], "prompt": " ".join(WORDS)})
    except httpx.HTTPError:
        tokenized = None
    if tokenized is not None and tokenized.status_code == 200:
        ids = sorted(set(tokenized.json()["tokens"]))
        per_word = max(1.0, tokenized.json()["count"] / len(WORDS))
    return ServerInfo(card["id"], int(card.get("max_model_len") or 2048), tuple(ids), per_word)


async def wait_idle(client: httpx.AsyncClient, gen: TrafficGenerator, timeout: float) -> tuple[bool, int]:
    """Wait until the running and waiting gauges read 0; returns (idle, probes sent).

    NOTE: the engine emits its gauges only when it steps, so an abort that leaves it with nothing to do
    leaves them stale; after a few seconds without idle gauges, a one-token probe makes it step once."""
    deadline, probes, last_probe = time.monotonic() + timeout, 0, time.monotonic()
    while time.monotonic() < deadline:
        m = await read_metrics(client)
        if m.get("kvserve:num_requests_running", 0) == 0 and m.get("kvserve:num_requests_waiting", 0) == 0:
            return True, probes
        if time.monotonic() - last_probe > 3:
            await send(client, gen.probe())
            probes, last_probe = probes + 1, time.monotonic()
        await asyncio.sleep(0.25)
    return False, probes


# ---- the run -------------------------------------------------------------------------------------
async def soak(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}", "x-api-key": args.api_key} if args.api_key else {}
    headers["anthropic-version"] = "2023-06-01"
    # NOTE: idle connections are dropped well before the server closes them (uvicorn: 5 s), so that a request
    # never races the server closing its kept-alive connection (a ReadError that is no fault of the server).
    limits = httpx.Limits(max_connections=args.concurrency + args.burst_size + 4, max_keepalive_connections=None,
                          keepalive_expiry=2.0)
    log_offset = os.path.getsize(args.log_file) if args.log_file and os.path.exists(args.log_file) else 0
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        info = await server_info(client)
        rng = random.Random(args.seed)
        gen = TrafficGenerator(info, rng)
        duration = 60.0 * args.minutes
        start = time.monotonic()
        deadline = start + duration
        results: list[Result] = []
        samples: list[dict] = []
        num_finished = 0

        async def counted(req: PlannedRequest) -> Result:
            nonlocal num_finished
            result = await send(client, req)
            num_finished += 1
            return result

        async def worker() -> None:
            while time.monotonic() < deadline:
                result = await counted(gen.next())
                results.append(result)
                if result.outcome == OVERLOADED:  # back off as a client honouring Retry-After would
                    await asyncio.sleep(rng.uniform(0.05, 0.5))

        async def bursts() -> None:
            gap = min(30.0, max(2.0, duration / 8))
            pending: list[asyncio.Task] = []
            while args.burst_size:
                await asyncio.sleep(min(rng.uniform(gap, 2 * gap), max(0.0, deadline - time.monotonic())))
                if time.monotonic() >= deadline:
                    break
                pending += [asyncio.create_task(counted(gen.next(burst=True))) for _ in range(args.burst_size)]
            results.extend(await asyncio.gather(*pending))

        async def sampler() -> None:
            interval = min(5.0, max(1.0, duration / 30))
            while time.monotonic() < deadline:
                m = await read_metrics(client)
                sample = {"elapsed_s": round(time.monotonic() - start, 3), "num_finished": num_finished}
                sample.update({key: m.get(name) for key, name in RSS_METRICS.items()})
                known = [v for v in (sample["server"], sample["engine"]) if v is not None]
                sample["total"] = sum(known) if known else None
                samples.append(sample)
                await asyncio.sleep(interval)

        await asyncio.gather(bursts(), sampler(), *(worker() for _ in range(args.concurrency)))
        traffic_s = time.monotonic() - start
        idle, num_probes = await wait_idle(client, gen, args.idle_timeout)
        kv = await kv_blocks(client)
        try:
            health = (await client.get("/health")).status_code
        except httpx.HTTPError:
            health = None
    after = AfterTraffic(idle, num_probes, kv, health, memory_slopes(samples, duration),
                         scan_log(args.log_file, log_offset))
    config = {k: getattr(args, k) for k in ("base_url", "minutes", "concurrency", "burst_size", "seed")}
    return build_report(config, info, results, traffic_s, after)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvserve.bench.soak`: the same as `kvserve bench soak`."""
    return standalone_main("kvserve bench soak", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
