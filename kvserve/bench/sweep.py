"""`kvserve bench sweep`: one server at several request rates, the serving curve (throughput vs latency).

At each rate of --rates the workload is replayed as `kvserve bench serve --request-rate RATE` does (the same
client: Poisson arrivals, streamed completions, token ids in; `inf` sends everything at once), one rate
after the other against the same server. One line per rate: achieved request rate, output and total tok/s,
TTFT and ITL p50 / p99. Every rate's full summary goes to a JSON file, and a PNG of throughput against p99
latency (bench/sweep_plot.py) is written next to it; `kvserve bench sweep-plot a.json b.json` draws several
engines' sweeps (their --label) in one figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import re
import time

from kvserve.bench import serve
from kvserve.bench.workload import load_workload
from kvserve.cli.standalone import standalone_main


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--workload", required=True, help="workload .jsonl file (one request per line), or a built-in name")
    parser.add_argument("--rates", default="1,2,4,8,16,inf",
                        help="comma-separated request rates (requests/s; inf: all at once)")
    parser.add_argument("--label", default=None, help="this engine's name in the plot (default: the model name)")
    parser.add_argument("--output", default=None,
                        help="JSON file to write (the PNG goes next to it, same name); default: "
                             "sweep-LABEL-TIME.json in the current folder")
    parser.add_argument("--model", default=None, help="model name to send; default: the first of /v1/models")
    parser.add_argument("--num-prompts", "--num-requests", dest="num_prompts", type=int, default=None,
                        help="replay only the first N requests at each rate (default: all)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="most requests in flight at once (default: no limit)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrival times")
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")


def parse_rates(text: str) -> list[float]:
    """'1,2,inf' -> [1.0, 2.0, inf]; every rate > 0, no duplicates."""
    rates = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--rates: {part!r} is not a number (requests/s, or inf)") from None
        if not rate > 0:
            raise ValueError(f"--rates: every rate must be > 0, got {part!r}")
        if rate in rates:
            raise ValueError(f"--rates: {part!r} appears twice")
        rates.append(rate)
    if not rates:
        raise ValueError("--rates: give at least one rate")
    return rates


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.sweep_plot import plot

    logging.getLogger("httpx").setLevel(logging.WARNING)
    rates = parse_rates(args.rates)
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    requests = load_workload(args.workload, args.num_prompts)
    report = {"label": args.label, "base_url": args.base_url, "workload": args.workload,
              "num_prompts": len(requests), "concurrency": args.concurrency, "seed": args.seed, "rates": []}
    print(f"{'rate':>6}{'done':>6}{'req/s':>8}{'out tok/s':>11}{'total tok/s':>13}{'TTFT p50':>10}{'p99':>9}"
          f"{'ITL p50':>9}{'p99':>8}   (ms)", flush=True)
    for rate in rates:
        arrivals = serve.arrival_times(requests, rate, args.seed)
        s = asyncio.run(serve.benchmark(args.base_url, requests, arrivals, model=args.model, api_key=args.api_key,
                                        concurrency=args.concurrency, timeout=args.timeout))
        report["label"] = report["label"] or s["model"]
        report["rates"].append({"request_rate": rate_name(rate)} | s)
        print(f"{rate_name(rate):>6}{s['completed']:>6}{s['request_throughput']:>8.2f}{s['output_throughput']:>11.1f}"
              f"{s['total_token_throughput']:>13.1f}{s['ttft']['median_ms']:>10.0f}{s['ttft']['p99_ms']:>9.0f}"
              f"{s['itl']['median_ms']:>9.0f}{s['itl']['p99_ms']:>8.0f}", flush=True)
        for error in s["errors"]:
            print(f"       error: {error}", flush=True)
    path = args.output or f"sweep-{re.sub(r'[^A-Za-z0-9._-]+', '_', report['label'])}-" \
                          f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    png = os.path.splitext(path)[0] + ".png"
    plot([report], png)
    print(f"results: {path}\nplot: {png}")
    return 0 if all(r["completed"] for r in report["rates"]) else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m kvserve.bench.sweep`: the same as `kvserve bench sweep`."""
    return standalone_main("kvserve bench sweep", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
