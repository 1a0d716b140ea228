"""`kvserve bench startup`: start `kvserve serve` in a fresh process N times and report where the seconds go.

Each repeat starts `python -m kvserve.cli.main serve` on a free port with the model flags given here (every
engine flag of `kvserve serve`), then measures from outside: when /health first answers 200 and when the
first token of one streamed completion arrives. The phases inside (import, tokenizer, config, weights,
kernels, kv cache, warm-up, ...) come from the server's own `startup:` log line (utils/startup_clock.py):
the front end loads the tokenizer while the engine process imports and loads the model, so phases overlap
and add up to more than `ready`. A server without that line (an older kvserve) still gets the outside
figures. Printed as a table (median, min and max over the repeats) and, with --json, as one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from kvserve.bench.engine_flags import engine_flags as serve_flags
from kvserve.cli.standalone import standalone_main
from kvserve.config import EngineArgs
from kvserve.utils.cpu_isa import selected_isa
from kvserve.utils.startup_clock import parse_phases

# The phases a server reports, in the order they happen (utils/startup_clock.py's names); others it reports
# are printed after these.
PHASES = ("import", "tokenizer", "front-end config", "engine import", "config", "kernels", "weights", "kv cache",
          "warm-up", "gc freeze", "ready")
OUTSIDE = ("health", "first token")
"""Measured by this benchmark: seconds from the process's start to /health answering 200, and to the first
streamed token of one request sent right after."""
_POLL_S = 0.05


@dataclass
class StartupRun:
    phases: dict[str, float] = field(default_factory=dict)
    outside: dict[str, float] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=3, help="server starts to measure (each a fresh process)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one start may take")
    parser.add_argument("--prompt", default="The capital of France is", help="the one request's prompt")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    engine_args = EngineArgs.from_cli(args)
    flags = serve_flags(engine_args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    runs = [start_once(flags, args.timeout, args.prompt) for _ in range(args.repeat)]
    summary = summarize(runs)
    report = {"command": ["kvserve", "serve", *flags], "isa": selected_isa(), "repeat": args.repeat,
              "runs": [dataclasses.asdict(r) for r in runs], "median_s": summary}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(runs, report["command"], report["isa"]))
    return 0


def start_once(flags: list[str], timeout: float, prompt: str) -> StartupRun:
    """One fresh `kvserve serve`: its own phases, /health and the first token, then a clean stop."""
    with tempfile.TemporaryDirectory() as folder:
        log = os.path.join(folder, "serve.log")
        cmd = [sys.executable, "-m", "kvserve.cli.main", "serve", "--host", "127.0.0.1", "--port", "0", *flags]
        start = time.monotonic()
        # NOTE: the server writes through its own append-mode file and this process reads through another: a
        # shared file offset would let our reads move where its writes land
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = _wait_for_port(proc, log, start + timeout)
            health = _wait_healthy(proc, base, start + timeout) - start
            first = _first_token(base, prompt, start + timeout) - start
        finally:
            _stop(proc)
        phases = next((p for p in map(parse_phases, _lines(log)) if p), {})
    return StartupRun(phases, {"health": health, "first token": first})


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.readlines()


def _wait_for_port(proc: subprocess.Popen, log: str, deadline: float) -> str:
    """The server's address, from its `serving on http://...` line (it chose the port)."""
    while time.monotonic() < deadline:
        for line in _lines(log):
            if line.startswith("kvserve: serving on "):
                return line.split("serving on ", 1)[1].strip()
        if proc.poll() is not None:
            tail = "".join(_lines(log)[-20:])
            raise RuntimeError(f"kvserve serve exited with {proc.returncode} before serving:\n{tail}")
        time.sleep(_POLL_S)
    raise RuntimeError("kvserve serve did not start within --timeout")


def _wait_healthy(proc: subprocess.Popen, base: str, deadline: float) -> float:
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=5.0).status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"kvserve serve exited with {proc.returncode} before /health answered")
        time.sleep(_POLL_S)
    raise RuntimeError("/health did not answer 200 within --timeout")


def _first_token(base: str, prompt: str, deadline: float) -> float:
    body = {"model": None, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    model = httpx.get(base + "/v1/models", timeout=10.0).json()["data"][0]["id"]
    body["model"] = model
    with httpx.stream("POST", base + "/v1/completions", json=body,
                      timeout=max(1.0, deadline - time.monotonic())) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.monotonic()
    raise RuntimeError("the completion stream ended without a token")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: the engine process goes with it
            proc.wait()


def summarize(runs: list[StartupRun]) -> dict[str, float]:
    """Median seconds of every phase and outside figure over the runs that report it."""
    names = _names(runs)
    return {name: statistics.median(_values(runs, name)) for name in names}


def _names(runs: list[StartupRun], every_phase: bool = False) -> list[str]:
    """What the runs report, in PHASES order; every_phase: PHASES' names too when the server reported phases."""
    seen = [n for r in runs for n in (*r.phases, *r.outside)]
    listed = every_phase and any(r.phases for r in runs)
    known = [n for n in (*PHASES, *OUTSIDE) if n in seen or (listed and n in PHASES)]
    return known + sorted(set(seen) - set(known))


def _values(runs: list[StartupRun], name: str) -> list[float]:
    return [r.phases.get(name, r.outside.get(name)) for r in runs
            if name in r.phases or name in r.outside]


def format_table(runs: list[StartupRun], command: list[str], isa: str) -> str:
    lines = [f"kvserve bench startup: {' '.join(command)} (ISA {isa}), {len(runs)} fresh start(s)",
             f"{'phase':<18}{'median s':>10}{'min s':>9}{'max s':>9}"]
    for name in _names(runs, every_phase=True):
        values = _values(runs, name)
        if not values:  # a phase this server does not have (no warm-up on the CPU, no engine process on a thread)
            lines.append(f"{name:<18}{'-':>10}{'-':>9}{'-':>9}")
            continue
        lines.append(f"{name:<18}{statistics.median(values):>10.2f}{min(values):>9.2f}{max(values):>9.2f}")
    lines.append("phases from the server's `startup:` log line (the tokenizer loads while the engine process "
                 "starts: they overlap); `health` and `first token`: seconds from the process's start, measured here")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return standalone_main("kvserve bench startup", "start `kvserve serve` N times: where the start-up seconds go",
                           add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
