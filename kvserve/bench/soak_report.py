"""The end of `kvserve bench soak`: what the server shows once the traffic stopped (KV gauges, resident
memory, its log) and the report over every request's Result, as a dict (--json) and as text."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.bench.soak_traffic import (ABORTED, COMPLETED, ENDPOINT_NAMES, OVERLOADED, REJECTED, UNEXPECTED, Result,
                                        ServerInfo)

WARMUP_FRACTION = 0.2
"""The first part of the run left out of the resident-memory slope (allocators and caches filling up)."""
RSS_METRICS = {"server": "process_resident_memory_bytes", "engine": "kvserve:engine_resident_memory_bytes"}
KV_METRICS = {"usage_perc": "kvserve:kv_cache_usage_perc", "pinned_blocks": "kvserve:prefix_cache_pinned_blocks",
              "request_blocks": "kvserve:kv_cache_request_blocks", "total_blocks": "kvserve:kv_cache_total_blocks"}
# NOTE: kvserve's own lines read "<time> ERROR <logger>: ...", uvicorn's "ERROR:    ...".
_LOG_ERROR = re.compile(r"Traceback|\sERROR\s|^ERROR:")


@dataclass
class AfterTraffic:
    """What the soak read from the server once its traffic stopped."""

    idle: bool
    """The running and waiting gauges read 0 within --idle-timeout."""
    num_probes: int
    kv: dict
    health_status: int | None
    memory: dict
    log: dict | None


async def read_metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """Sample name -> value summed over label sets; empty if /metrics cannot be read."""
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def kv_blocks(client: httpx.AsyncClient) -> dict:
    """The KV gauges at idle, and the blocks still held by requests (leaked): kv_cache_request_blocks
    where exported, else usage x total blocks - pinned blocks; None where that cannot be known."""
    m = await read_metrics(client)
    kv = {key: m.get(name) for key, name in KV_METRICS.items()}
    if kv["total_blocks"] is None:  # NOTE: kvserve's debug endpoint knows the pool's size
        try:
            debug = await client.get("/debug/prefix-cache")
            if debug.status_code == 200:
                kv["total_blocks"] = debug.json().get("total_blocks")
        except (httpx.HTTPError, ValueError):
            pass
    usage, total, pinned = kv["usage_perc"], kv["total_blocks"], kv["pinned_blocks"]
    if kv["request_blocks"] is not None:
        kv["leaked_blocks"], kv["leaked_from"] = int(kv["request_blocks"]), "kv_cache_request_blocks"
    elif usage is not None and total is not None:
        kv["leaked_blocks"] = max(0, round(usage * total) - int(pinned or 0))
        kv["leaked_from"] = "kv_cache_usage_perc x total blocks - pinned blocks"
    elif usage == 0:
        kv["leaked_blocks"], kv["leaked_from"] = 0, "kv_cache_usage_perc is 0"
    else:
        kv["leaked_blocks"], kv["leaked_from"] = None, "n/a (no request-block or total-block figure)"
    return kv


def scan_log(path: str | None, offset: int) -> dict | None:
    """Traceback and ERROR lines the server logged after byte `offset`. A traceback is shown as its
    exception line and the last frame it names."""
    if path is None:
        return None
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    found = []
    for i, line in enumerate(lines):
        if not _LOG_ERROR.search(line):
            continue
        if "Traceback" in line:
            end = next((j for j in range(i + 1, len(lines)) if lines[j] and not lines[j][0].isspace()), len(lines))
            frames = [x.strip() for x in lines[i + 1:end] if x.strip().startswith("File ")]
            exception = lines[end].strip() if end < len(lines) else "(cut off)"
            line = f"Traceback: {exception}" + (f" [{frames[-1]}]" if frames else "")
        found.append(line.strip()[:400])
    return {"path": path, "num_error_lines": len(found), "first_lines": found[:10]}


def memory_slopes(samples: list[dict], duration_s: float) -> dict:
    """Least-squares slope of resident MB against requests finished, per 1,000 requests, after warm-up."""
    used = [s for s in samples if s["elapsed_s"] >= WARMUP_FRACTION * duration_s]
    slopes = {}
    for key in (*RSS_METRICS, "total"):
        points = [(s["num_finished"] / 1000, s[key] / 1e6) for s in used if s.get(key) is not None]
        slopes[f"{key}_mb_per_1k_requests"] = _slope(points)
    return {"warmup_fraction": WARMUP_FRACTION, "num_samples": len(samples), "num_samples_used": len(used),
            **slopes, "samples": samples}


def _slope(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var


def build_report(config: dict, info: ServerInfo, results: list[Result], traffic_s: float,
                 after: AfterTraffic) -> dict:
    """Every figure of the soak; `passed` is the exit status's condition."""
    planned = [r.planned for r in results]
    traffic = Counter(ENDPOINT_NAMES[p.endpoint] for p in planned)
    traffic.update("streamed" if p.stream else "whole" for p in planned)
    traffic.update(tag for p in planned for tag in p.tags if not tag.startswith("invalid:"))
    traffic["disconnect_planned"] = sum(p.disconnect_after_chunks is not None or p.cancel_after_s is not None
                                        for p in planned)
    invalid_kinds = Counter(t.split(":", 1)[1] for p in planned for t in p.tags if t.startswith("invalid:"))
    outcomes = Counter(r.outcome for r in results)
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        if r.outcome == UNEXPECTED:
            groups.setdefault((r.status, ENDPOINT_NAMES[r.planned.endpoint], r.problem), []).append(r)
    unexpected = [{"status": status, "endpoint": endpoint, "problem": problem, "count": len(rs),
                   "stream": rs[0].planned.stream, "tags": list(rs[0].planned.tags),
                   "request": rs[0].planned.body[:300].decode(errors="replace"), "excerpt": rs[0].excerpt}
                  for (status, endpoint, problem), rs in sorted(groups.items(), key=lambda g: -len(g[1]))]
    failures = []
    if outcomes[UNEXPECTED]:
        failures.append(f"{outcomes[UNEXPECTED]} unexpected answers")
    if after.log and after.log["num_error_lines"]:
        failures.append(f"{after.log['num_error_lines']} Traceback/ERROR lines in the server log")
    if after.kv["leaked_blocks"]:
        failures.append(f"{after.kv['leaked_blocks']} leaked KV blocks")
    if not after.idle:
        failures.append("the server did not go idle after the traffic stopped")
    if after.health_status != 200:
        failures.append(f"/health answered {after.health_status}")
    statuses = Counter(r.status for r in results if r.status is not None)
    return {
        "config": {**config, "model": info.model, "max_model_len": info.max_model_len},
        "duration_s": round(traffic_s, 3), "num_requests": len(results),
        "traffic": dict(sorted(traffic.items())), "invalid_kinds": dict(sorted(invalid_kinds.items())),
        "outcomes": {"by_status": {str(k): v for k, v in sorted(statuses.items())},
                     "completed": outcomes[COMPLETED],
                     "completed_streams": sum(r.outcome == COMPLETED and r.planned.stream for r in results),
                     "client_aborted": outcomes[ABORTED], "overloaded": outcomes[OVERLOADED],
                     "rejected_invalid": outcomes[REJECTED], "unexpected": outcomes[UNEXPECTED]},
        "unexpected": unexpected,
        "idle": after.idle, "idle_probes": after.num_probes, "kv": after.kv, "memory": after.memory,
        "log": after.log, "health_status": after.health_status,
        "passed": not failures, "verdict": "PASS" if not failures else "FAIL: " + "; ".join(failures),
    }


def format_report(r: dict) -> str:
    def fmt(value, spec: str = ".4g") -> str:
        return "n/a" if value is None else format(value, spec)

    o, kv, mem = r["outcomes"], r["kv"], r["memory"]
    lines = ["{s:{c}^72}".format(s=" Soak Result ", c="="),
             f"requests: {r['num_requests']} in {r['duration_s']:.1f} s against {r['config']['model']}",
             "traffic: " + ", ".join(f"{k} {v}" for k, v in r["traffic"].items()),
             "HTTP status: " + ", ".join(f"{k}: {v}" for k, v in o["by_status"].items()),
             f"completed: {o['completed']} ({o['completed_streams']} streams), client-aborted: "
             f"{o['client_aborted']}, overloaded (429/529): {o['overloaded']}, invalid rejected: "
             f"{o['rejected_invalid']}, unexpected: {o['unexpected']}"]
    for u in r["unexpected"][:10]:
        kind = next((t for t in u["tags"] if t.startswith("invalid:")), "valid")
        lines.append(f"  unexpected x{u['count']}: {u['status']} {u['endpoint']}{' stream' if u['stream'] else ''}"
                     f" ({kind}) {u['problem']}: {u['excerpt'][:160]!r}")
    lines.append(f"server idle after the traffic: {r['idle']} ({r['idle_probes']} probe requests)")
    lines.append(f"KV blocks at idle: leaked {fmt(kv['leaked_blocks'], '')} ({kv['leaked_from']}); request blocks "
                 f"{fmt(kv['request_blocks'])}, pinned {fmt(kv['pinned_blocks'])}, total {fmt(kv['total_blocks'])}, "
                 f"usage {fmt(kv['usage_perc'])}")
    slopes = ", ".join(f"{k} {fmt(mem[f'{k}_mb_per_1k_requests'], '+.2f')}" for k in ("server", "engine", "total"))
    lines.append(f"resident memory slope after the first {WARMUP_FRACTION:.0%} ({mem['num_samples_used']} of "
                 f"{mem['num_samples']} samples), MB per 1,000 requests: {slopes}")
    if r["log"] is not None:
        lines.append(f"server log: {r['log']['num_error_lines']} Traceback/ERROR lines")
        lines += [f"  {line[:240]}" for line in r["log"]["first_lines"][:5]]
    lines.append(f"/health: {fmt(r['health_status'], '')}")
    lines.append(f"soak: {r['verdict']}")
    return "\n".join(lines)
