"""`kvserve bench serve`: replay a workload against any OpenAI-compatible server, report like `vllm bench serve`.

Each workload line (see the workloads README) becomes one streamed POST /v1/completions with the
line's token ids as `prompt`, its max_tokens and ignore_eos, temperature 0. Arrivals follow the
workload's `arrival_s`, or a Poisson process with --request-rate; --concurrency caps requests in flight.

Per request: time to first token (TTFT, to the first chunk with a choice), inter-token latencies (ITL,
between consecutive such chunks), time per output token after the first (TPOT = (latency - TTFT) /
(output tokens - 1)) and end-to-end latency. Output tokens come from the final usage chunk
(stream_options.include_usage); a server that sends none is counted by chunks.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from kvserve.bench.workload import WorkloadRequest, load_workload
from kvserve.cli.standalone import standalone_main


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--workload", required=True, help="workload .jsonl file (one request per line), or a built-in name")
    parser.add_argument("--model", default=None, help="model name to send; default: the first of /v1/models")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="most requests in flight at once (default: no limit)")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="Poisson arrivals at this many requests/s (inf: all at once); "
                             "default: the workload's arrival_s")
    parser.add_argument("--num-prompts", "--num-requests", dest="num_prompts", type=int, default=None,
                        help="replay only the first N requests (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrival times")
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.request_rate is not None and not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    requests = load_workload(args.workload, args.num_prompts)
    arrivals = arrival_times(requests, args.request_rate, args.seed)
    summary = asyncio.run(benchmark(args.base_url, requests, arrivals, model=args.model, api_key=args.api_key,
                                    concurrency=args.concurrency, timeout=args.timeout))
    summary["config"] = {"workload": args.workload, "concurrency": args.concurrency,
                         "request_rate": args.request_rate, "num_prompts": len(requests)}
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0 if summary["completed"] else 1


def arrival_times(requests: list[WorkloadRequest], request_rate: float | None, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent."""
    if request_rate is None:
        return [r.arrival_s for r in requests]
    if math.isinf(request_rate):
        return [0.0] * len(requests)
    rng, t, times = random.Random(seed), 0.0, []
    for _ in requests:
        times.append(t)
        t += rng.expovariate(request_rate)
    return times


async def benchmark(base_url: str, requests: list[WorkloadRequest], arrivals: list[float], *,
                    model: str | None = None, api_key: str | None = None, concurrency: int | None = None,
                    timeout: float = 600.0) -> dict:
    start = time.perf_counter()
    results, model = await collect(base_url, requests, arrivals, model=model, api_key=api_key,
                                   concurrency=concurrency, timeout=timeout)
    return summarize(results, time.perf_counter() - start, model)


async def collect(base_url: str, requests: list[WorkloadRequest], arrivals: list[float], *,
                  model: str | None = None, api_key: str | None = None, concurrency: int | None = None,
                  timeout: float = 600.0) -> tuple[list[RequestResult], str]:
    """Send every request at its arrival time: one RequestResult per request, in workload order, and the
    model name sent."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency or len(requests), max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout)) as client:
        if model is None:
            model = await first_model(client, base_url)
        gate = asyncio.Semaphore(concurrency) if concurrency else None
        start = time.perf_counter()

        async def one(req: WorkloadRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if gate is None:
                return await send_request(client, model, req)
            async with gate:
                return await send_request(client, model, req)

        results = list(await asyncio.gather(*(one(r, t) for r, t in zip(requests, arrivals))))
    return results, model


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model of GET /v1/models; ValueError (the CLI's clear error) when the server cannot be reached
    or does not answer with a model list."""
    try:
        r = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {base_url}: {e or type(e).__name__}") from None
    try:
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"GET {base_url.rstrip('/')}/v1/models answered {r.status_code} without a model: "
                         f"{r.text[:200]}") from None


async def send_request(client: httpx.AsyncClient, model: str, req: WorkloadRequest) -> RequestResult:
    # NOTE: plain greedy on every engine: repetition_penalty 1.0 (the extension vLLM and kvserve take, as
    # ignore_eos) overrides kvserve's built-in-model default of 1.1, which no peer applies.
    payload = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
               "ignore_eos": req.ignore_eos, "temperature": 0.0, "repetition_penalty": 1.0, "stream": True,
               "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False, prompt_tokens=len(req.prompt_token_ids))
    num_chunks, usage_tokens = 0, None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                if chunk.get("choices"):
                    result.text += chunk["choices"][0].get("text") or ""
                    now = time.perf_counter()
                    if num_chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itls_s.append(now - last)
                    last, num_chunks = now, num_chunks + 1
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency_s = last - start
    result.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
    result.ok = num_chunks > 0
    if not result.ok:
        result.error = "the stream carried no tokens"
    return result


def _stats(values: list[float]) -> dict[str, float]:
    """mean / median / p99 in milliseconds (0 when there are no values)."""
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    # NOTE: linear interpolation between closest ranks, as numpy.percentile's default (vLLM's report).
    pos = 0.99 * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    p99 = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    return {"mean_ms": 1000 * statistics.fmean(ordered), "median_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * p99}


def summarize(results: list[RequestResult], duration: float, model: str) -> dict:
    ok = [r for r in results if r.ok]
    num_in = sum(r.prompt_tokens for r in ok)
    num_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return {
        "model": model, "completed": len(ok), "failed": len(errors), "duration_s": duration,
        "total_input_tokens": num_in, "total_output_tokens": num_out,
        "request_throughput": len(ok) / duration, "output_throughput": num_out / duration,
        "total_token_throughput": (num_in + num_out) / duration,
        "ttft": _stats([r.ttft_s for r in ok]), "tpot": _stats(tpots),
        "itl": _stats([x for r in ok for x in r.itls_s]), "e2el": _stats([r.latency_s for r in ok]),
        "errors": sorted(set(errors))[:5],
    }


def format_summary(s: dict) -> str:
    def row(label: str, value, fmt: str = "{:.2f}") -> str:
        return f"{label:<40}{fmt.format(value) if not isinstance(value, str) else value:>12}"

    lines = ["{s:{c}^52}".format(s=" Serving Benchmark Result ", c="="),
             row("Successful requests:", s["completed"], "{}"), row("Failed requests:", s["failed"], "{}"),
             row("Benchmark duration (s):", s["duration_s"]),
             row("Total input tokens:", s["total_input_tokens"], "{}"),
             row("Total generated tokens:", s["total_output_tokens"], "{}"),
             row("Request throughput (req/s):", s["request_throughput"]),
             row("Output token throughput (tok/s):", s["output_throughput"]),
             row("Total token throughput (tok/s):", s["total_token_throughput"])]
    for key, title, short in (("ttft", "Time to First Token", "TTFT"),
                              ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^52}".format(s=title, c="-"))
        for stat, name in (("mean_ms", "Mean"), ("median_ms", "Median"), ("p99_ms", "P99")):
            lines.append(row(f"{name} {short} (ms):", s[key][stat]))
    lines.append("=" * 52)
    for error in s["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvserve.bench.serve`: the same as `kvserve bench serve`."""
    return standalone_main("kvserve bench serve", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
