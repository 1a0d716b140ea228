"""Benchmark workloads: JSONL request sets with token ids (see workloads/README.md beside this file).

The built-in ones ship in the package (kvserve/bench/workloads/): `--workload mixed` names one, and any other
value is a path."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadRequest:
    id: str
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = True
    arrival_s: float = 0.0


WORKLOAD_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads")
BUILTIN_WORKLOADS = ("mixed", "prefix", "interference", "repeat", "groups")


def workload_path(name_or_path: str) -> str:
    """The packaged file of a built-in workload's name (unless a file of that name is here); else the path."""
    if name_or_path in BUILTIN_WORKLOADS and not os.path.exists(name_or_path):
        return os.path.join(WORKLOAD_DIR, f"{name_or_path}.jsonl")
    return name_or_path


def load_workload(path: str, limit: int | None = None) -> list[WorkloadRequest]:
    """The requests of a workload file, or of a built-in workload given by name (see workload_path)."""
    path = workload_path(path)
    requests = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                requests.append(WorkloadRequest(str(item.get("id", n)), list(item["prompt_token_ids"]),
                                                int(item["max_tokens"]), bool(item.get("ignore_eos", True)),
                                                float(item.get("arrival_s", 0.0))))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: not a workload request ({e})") from None
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests[:limit] if limit else requests
