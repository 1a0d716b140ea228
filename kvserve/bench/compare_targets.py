"""The issues' targets for `kvserve bench compare`, checked on one run's report: each a ratio, met or missed.

Rows that a run did not include are skipped, so a subset run (`--peers quant`) reports only its own targets.
Targets against "the best peer" take the plain (fp32) rows of the other engines, or, for the default-precision
target, each engine's row at its own default precision.
"""
from __future__ import annotations

from kvserve.bench.peers import PEERS

DECODE1 = "decode1"
_MIXED_FP32 = {"vllm": 1.2, "openvino": 1.05, "llamacpp": 1.0}
# (kvserve row, its baseline row, workload, at least): each quantized row against what it must beat
_QUANT = (
    ("kvserve-int8", "kvserve", DECODE1, 2.5),
    ("kvserve-int8", "llamacpp-q8_0", DECODE1, 1.0),
    ("kvserve-gguf", "llamacpp-q4_1", DECODE1, 1.0),
    ("kvserve-int8", "openvino-int8", "mixed", 1.0),
    ("kvserve-kv8", "kvserve", "mixed", 0.95),
)
_DEFAULT_PRECISION_PEERS = ("vllm-bf16", "openvino-default", "llamacpp")
# single-stream decode of these rows as a fraction of the weight-streaming limit (bench/streaming.py): at least
_STREAMING = {"kvserve": 0.8, "kvserve-int8": 0.8}


def decode_tok_s(row: dict) -> float | None:
    """Single-stream decode rate: 1000 / the mean time per output token after the first."""
    if not row or "error" in row or not row.get("completed"):
        return None
    mean = row.get("tpot", {}).get("mean_ms")
    return 1000.0 / mean if mean else None


def _tps(report: dict, workload: str, name: str) -> float | None:
    row = report["workloads"].get(workload, {}).get(name)
    if not row or "error" in row or not row.get("completed"):
        return None
    return decode_tok_s(row) if workload == DECODE1 else row["total_token_throughput"]


def _ratio_target(out: list, report: dict, mine: str, theirs: str, workload: str, want: float) -> None:
    a, b = _tps(report, workload, mine), _tps(report, workload, theirs)
    if a and b:
        what = "single-stream decode tok/s" if workload == DECODE1 else f"{workload} total tok/s"
        out.append({"target": f"{what}: {mine} >= {want}x {theirs}", "value": a / b, "met": a / b >= want})


def targets(report: dict) -> list[dict]:
    out: list[dict] = []
    for peer, want in _MIXED_FP32.items():
        _ratio_target(out, report, "kvserve", peer, "mixed", want)
    for name, row in report["workloads"].get("interference", {}).items():
        itl = row.get("itl_first_arrivals", {})
        if name.startswith("kvserve") and itl.get("median_ms"):
            ratio = itl["p99_ms"] / itl["median_ms"]
            out.append({"target": f"interference ({name}): short requests' ITL p99 <= 3x p50", "value": ratio,
                        "met": ratio <= 3})
    kv_prefix = _tps(report, "prefix", "kvserve")
    plain = [t for n in report["workloads"].get("prefix", {})
             if not n.startswith("kvserve") and n in PEERS and not PEERS[n].engine
             for t in [_tps(report, "prefix", n)] if t]
    if kv_prefix and plain:
        ratio = kv_prefix / max(plain)
        out.append({"target": "prefix: kvserve total tok/s >= 1.5x the best fp32 peer", "value": ratio,
                    "met": ratio >= 1.5})
    for mine, theirs, workload, want in _QUANT:
        _ratio_target(out, report, mine, theirs, workload, want)
    auto = _tps(report, "mixed", "kvserve-bf16")
    natives = [(n, t) for n in _DEFAULT_PRECISION_PEERS for t in [_tps(report, "mixed", n)] if t]
    if auto and natives:
        best, t = max(natives, key=lambda x: x[1])
        out.append({"target": f"mixed at default precisions: kvserve-bf16 >= 1.0x the best peer ({best})",
                    "value": auto / t, "met": auto / t >= 1.0})
    streaming = (report.get("streaming") or {}).get("rows", {})
    for name, want in _STREAMING.items():
        if name in streaming:
            frac = streaming[name]["fraction"]
            out.append({"target": f"single-stream decode ({name}): >= {want:.0%} of the weight-streaming limit",
                        "value": frac, "met": frac >= want})
    if report.get("roofline"):
        frac = report["roofline"]["fraction"]
        out.append({"target": "mixed: achieved >= 75% of the machine's fp32 matmul rate", "value": frac,
                    "met": frac >= 0.75})
    return out
