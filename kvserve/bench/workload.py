"""Benchmark workloads: JSONL request sets with token ids (see workloads/README.md beside this file).

The built-in ones ship in the package (kvserve/bench/workloads/): `--workload mixed` names one, and any other
value is a path."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar


@dataclass(frozen=True)
class WorkloadRequest:
    id: str
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = True
    arrival_s: float = 0.0


T = TypeVar("T")
WORKLOAD_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads")
BUILTIN_WORKLOADS = ("mixed", "prefix", "interference", "repeat", "groups")


def workload_path(name_or_path: str) -> str:
    """The packaged file of a built-in workload's name (unless a file of that name is here); else the path."""
    if name_or_path in BUILTIN_WORKLOADS and not os.path.exists(name_or_path):
        return os.path.join(WORKLOAD_DIR, f"{name_or_path}.jsonl")
    return name_or_path


def read_jsonl(path: str, what: str, convert: Callable[[int, dict], T]) -> list[T]:
    """convert(line number, object) of each non-blank line of a JSONL file; a line that is not JSON or that
    convert refuses (KeyError, TypeError, ValueError) is a ValueError naming the file and the line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(convert(n, json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: not a {what} ({e})") from None
    return out


def load_workload(path: str, limit: int | None = None) -> list[WorkloadRequest]:
    """The requests of a workload file, or of a built-in workload given by name (see workload_path)."""
    path = workload_path(path)
    requests = read_jsonl(path, "workload request", lambda n, item: WorkloadRequest(
        str(item.get("id", n)), list(item["prompt_token_ids"]), int(item["max_tokens"]),
        bool(item.get("ignore_eos", True)), float(item.get("arrival_s", 0.0))))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests[:limit] if limit else requests
