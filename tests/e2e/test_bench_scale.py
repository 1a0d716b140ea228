"""`kvserve bench scale --quick --sections b` on a tiny checkpoint, end to end: two pinned replicas, a router per
policy and one 2-thread engine run both routing workloads; every request succeeds, the router's counts add up,
and the report prints the targets beside the figures. Its arithmetic is tests/unit/test_bench_scale.py (fast)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # starts 3 servers and 3 routers: minutes on 2 loaded cores
def test_bench_scale_quick_routing_section(tiny_llama, tmp_path):
    cmd = [sys.executable, "-m", "kvserve.cli.main", "bench", "scale", "--quick", "--sections", "b", "--json",
           "--model", tiny_llama[0], "--log-dir", str(tmp_path / "logs"), "--kv-cache-memory", "32MiB"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "b) routing over 2 replicas" in out and "target (groups): precise within 2 points" in out
    report = json.loads(out[out.index("\n{") + 1:])
    section = report["b"]
    assert set(section["workloads"]) == {"groups", "chat"}
    for name, workload in section["workloads"].items():
        assert 0 < workload["best_hit_rate"] < 1 and workload["capacity_ok"]
        policies = workload["policies"]
        assert set(policies) == {"round_robin", "cache_aware", "precise", "one engine (2 threads)"}
        for policy, result in policies.items():
            assert result["failed"] == 0, (name, policy, result["errors"])
            assert 0 < result["hit_rate"] <= 1 and result["ttft"]["median_ms"] > 0
            if "requests_per_replica" in result:
                assert sum(result["requests_per_replica"]) == workload["requests"]
        assert policies["round_robin"]["skew"] <= 1.5
