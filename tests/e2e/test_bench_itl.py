"""`kvserve bench itl` on a tiny model and a miniature interference / mixed pair: both settings run, every
short request's ITL and the late prompt's TTFT are reported, and bad --targets exit 2."""
from __future__ import annotations

import json

from kvserve.bench import itl


def _write(path, rows) -> None:
    with open(path, "w") as f:
        for i, (n, max_tokens, at) in enumerate(rows):
            f.write(json.dumps({"id": f"r{i}", "prompt_token_ids": [(7 * i + j) % 200 + 3 for j in range(n)],
                                "max_tokens": max_tokens, "ignore_eos": True, "arrival_s": at}) + "\n")


def test_both_settings_measured(tiny_llama, tmp_path, capsys):
    _write(tmp_path / "interference.jsonl", [(5, 30, 0.0), (6, 30, 0.0), (120, 3, 0.05)])
    _write(tmp_path / "mixed.jsonl", [(20, 5, 0.0), (40, 4, 0.0), (9, 6, 0.0)])
    argv = ["--workload-dir", str(tmp_path), "--model", tiny_llama[0], "--targets", "0.001,0",
            "--num-gpu-blocks-override", "64", "--max-model-len", "256", "--max-num-batched-tokens", "64",
            "--json"]
    assert itl.main(argv) == 0
    out = capsys.readouterr().out
    results = json.loads(out[out.index("\n[\n") + 1:])
    assert [r["target_itl_ms"] for r in results] == [0.001, 0.0]
    for r in results:
        assert 0 < r["short_itl"]["median_ms"] <= r["short_itl"]["p99_ms"]
        assert r["long_ttft"]["median_ms"] > 0 and r["mixed_total_tps"] > 0
        assert 0 < r["mixed_ttft"]["median_ms"] <= r["mixed_ttft"]["p99_ms"]
    assert "vs fixed" in out and "1.000x" in out
    assert "[itl] target 0.001 ms: fitted step cost" in out and "ms/token" in results[0]["step_cost"]
    assert "fitted step cost" not in out.split("[itl] target 0 ms")[1]


def test_auto_and_rounds_interleaved(tiny_llama, tmp_path, capsys):
    _write(tmp_path / "interference.jsonl", [(5, 12, 0.0), (6, 12, 0.0), (120, 2, 0.02)])
    _write(tmp_path / "mixed.jsonl", [(20, 3, 0.0), (40, 2, 0.0)])
    argv = ["--workload-dir", str(tmp_path), "--model", tiny_llama[0], "--targets", "auto,0", "--repeat", "2",
            "--num-gpu-blocks-override", "64", "--max-model-len", "256", "--max-num-batched-tokens", "64", "--json"]
    assert itl.main(argv) == 0
    out = capsys.readouterr().out
    results = json.loads(out[out.index("\n[\n") + 1:])
    assert [(r["target_itl_ms"], r["round"]) for r in results] == [("auto", 0), (0.0, 0), ("auto", 1), (0.0, 1)]
    assert "[itl] target auto (round 2): fitted step cost" in out and "cpu isa:" in out
    table = out[out.index("--target-itl-ms"):out.index("targets:")].splitlines()
    assert [line.split()[0] for line in table[1:]] == ["auto", "0"] and "mixed TTFT p50" in table[0]


def test_bad_targets_exit_2(tmp_path, capsys):
    for bad in ("x", "-1", ","):
        assert itl.main(["--workload-dir", str(tmp_path), "--targets", bad]) == 2
        assert "--targets" in capsys.readouterr().err
