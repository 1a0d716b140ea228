"""Where a server's start-up seconds go: named phases, timed where they happen, reported as one log line.

The server logs `startup: import 1.92 s, tokenizer 0.41 s, ..., ready 4.80 s` once it is ready
(`format_phases`), and `kvserve bench startup` reads that line back (`parse_phases`), so the breakdown it
prints is the server's own measurement, not the benchmark's guess.
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

STARTUP_PREFIX = "startup: "
_PHASE_RE = re.compile(r"([a-z][a-z0-9 -]*?) (\d+(?:\.\d+)?) s(?:,|$)")


def process_age_s() -> float:
    """Seconds since this process started (the kernel's start time, so it includes the interpreter's own
    start and every import before the caller ran); 0.0 where the platform does not say."""
    try:
        with open("/proc/self/stat", "rb") as f:
            # the command name (field 2) may hold spaces and parentheses: count fields after its last ')'
            fields = f.read().rsplit(b")", 1)[1].split()
        start_ticks = int(fields[19])                      # field 22: starttime, clock ticks after boot
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


@dataclass
class PhaseTimes:
    """Seconds per named phase, in the order they were first timed (a repeated phase adds up)."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


def format_phases(phases: dict[str, float]) -> str:
    """`startup: import 1.92 s, weights 0.80 s` (phase names: lowercase words)."""
    return STARTUP_PREFIX + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items())


def parse_phases(line: str) -> dict[str, float] | None:
    """The phases of a log line holding `format_phases`' text, or None if the line has none."""
    at = line.find(STARTUP_PREFIX)
    if at < 0:
        return None
    return {name: float(seconds) for name, seconds in _PHASE_RE.findall(line[at + len(STARTUP_PREFIX):])}
