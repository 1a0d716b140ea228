"""scripts/gpu_bench.py and gpu_table.py (what scripts/gpu_check.sh runs on a GPU) smoke-tested on the CPU with
a tiny dummy model, so the prepared GPU run does not rot between GPU machines."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.model_loader.dummy import builtin_config_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_bench_flow_and_table_on_cpu(tmp_path):
    cfg = json.load(open(f"{builtin_config_dir('SmolLM2-135M')}/config.json"))
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=50000, max_position_embeddings=4096)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "bench.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "scripts/gpu_bench.py", "--device", "cpu", "--model", str(tmp_path),
                    "--num-requests", "3", "--workload", str(tmp_path / "absent.jsonl"), "--out", str(out)],
                   cwd=REPO, env=env, check=True, timeout=600, capture_output=True)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["device", "startup", "offline", "decode", "decode", "offline"]
    assert rows[0]["workload"].startswith("synthetic")
    assert [r["batch"] for r in rows if r["kind"] == "decode"] == [1, 64]
    table = subprocess.run([sys.executable, "scripts/gpu_table.py", str(out)], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout
    assert "decode batch 1" in table and "mixed: kvserve / transformers" in table
