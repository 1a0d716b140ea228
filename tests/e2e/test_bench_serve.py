"""`kvserve bench serve` against a real `kvserve serve` (tiny model), plus its arithmetic in isolation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.bench import serve as bench
from kvserve.bench.workload import workload_path
from tests.helpers.bench import workload_like_mixed


def test_replays_a_workload_and_reports_json(base_url, tmp_path, capsys):
    lengths = [(40, 8), (20, 5), (64, 12), (33, 3), (50, 9), (17, 6)]
    workload = workload_like_mixed(tmp_path / "w.jsonl", lengths)
    assert bench.main(["--base-url", base_url, "--workload", workload, "--concurrency", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_input_tokens"] == sum(p for p, _ in lengths)
    assert result["total_output_tokens"] == sum(m for _, m in lengths)
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / result["duration_s"])
    for key in ("ttft", "tpot", "itl", "e2el"):
        s = result[key]
        assert 0 < s["median_ms"] <= s["p99_ms"] and s["mean_ms"] > 0, (key, s)
    assert result["e2el"]["mean_ms"] > result["ttft"]["mean_ms"]


def test_table_output_and_failed_requests(base_url, tmp_path, capsys):
    workload = workload_like_mixed(tmp_path / "w.jsonl", [(16, 4), (1100, 4), (16, 4)])  # 1100 > max_model_len
    assert bench.main(["--base-url", base_url, "--workload", workload, "--request-rate", "20"]) == 0
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "P99 ITL (ms):" in out and "Output token throughput" in out
    lines = {line.split(":")[0]: line.split()[-1] for line in out.splitlines() if ":" in line}
    assert lines["Successful requests"] == "2" and lines["Failed requests"] == "1"
    assert "HTTP 400" in out and "max_model_len" in out


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    reqs = [bench.WorkloadRequest(str(i), [1], 1, True, 0.5 * i) for i in range(2000)]
    a = bench.arrival_times(reqs, 10.0, seed=1)
    assert a == bench.arrival_times(reqs, 10.0, seed=1) != bench.arrival_times(reqs, 10.0, seed=2)
    assert a[0] == 0 and all(x <= y for x, y in zip(a, a[1:]))
    assert len(a) / a[-1] == pytest.approx(10.0, rel=0.1)
    assert bench.arrival_times(reqs, None, 0)[:3] == [0.0, 0.5, 1.0]
    assert bench.arrival_times(reqs, float("inf"), 0)[-1] == 0.0


def test_percentiles_match_numpy_linear_interpolation():
    s = bench._stats([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s["mean_ms"] == pytest.approx(50.5) and s["median_ms"] == pytest.approx(50.5)
    assert s["p99_ms"] == pytest.approx(99.01)
    assert bench._stats([]) == {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    import socket

    from kvserve.cli.main import main

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workload = tmp_path / "w.jsonl"
    workload.write_text(Path(workload_path("mixed")).read_text().splitlines()[0] + "\n")
    for command in (["bench", "serve"], ["bench", "sweep", "--rates", "1", "--output", str(tmp_path / "s.json")]):
        assert main([*command, "--base-url", f"http://127.0.0.1:{port}", "--workload", str(workload)]) == 2
        assert f"kvserve: error: cannot reach http://127.0.0.1:{port}" in capsys.readouterr().err
