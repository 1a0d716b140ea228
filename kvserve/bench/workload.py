"""Benchmark workloads: JSONL request sets with token ids (see shared/workloads/README.md)."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadRequest:
    id: str
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = True
    arrival_s: float = 0.0


def load_workload(path: str, limit: int | None = None) -> list[WorkloadRequest]:
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
