"""`kvserve bench sweep` against a real `kvserve serve` (tiny model, a few requests, two rates) and
`kvserve bench sweep-plot`: the JSON per rate and a valid PNG next to it."""
from __future__ import annotations

import json
import math
import struct
import zlib

import pytest

from kvserve.bench import sweep, sweep_plot
from tests.helpers.bench import workload_like_mixed


def _assert_png(path) -> None:
    """A PNG: the signature, then chunks whose CRCs check, IHDR first with a real size, IEND last."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, kinds = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        kinds.append(kind)
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
            assert width > 100 and height > 100
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds


def test_sweep_two_rates_writes_json_and_png(base_url, tmp_path, capsys):  # noqa: F811
    workload = workload_like_mixed(tmp_path / "w.jsonl", [(30, 5), (20, 4), (40, 6), (25, 3)])
    out = tmp_path / "res" / "tiny.json"
    assert sweep.main(["--base-url", base_url, "--workload", workload, "--rates", "4,inf", "--label", "tiny",
                       "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [line.split() for line in printed.splitlines() if line.split() and line.split()[0] in ("4", "inf")]
    assert [r[0] for r in rows] == ["4", "inf"] and all(r[1] == "4" for r in rows), printed
    report = json.loads(out.read_text())
    assert report["label"] == "tiny" and [r["request_rate"] for r in report["rates"]] == ["4", "inf"]
    for r in report["rates"]:
        assert r["completed"] == 4 and r["failed"] == 0 and r["total_output_tokens"] == 18
        assert 0 < r["ttft"]["median_ms"] <= r["ttft"]["p99_ms"] and 0 < r["itl"]["median_ms"] <= r["itl"]["p99_ms"]
    # Poisson at 4 req/s: the run lasts at least until its last arrival (inf sends all at t=0).
    last_arrival = sweep.serve.arrival_times([None] * 4, 4.0, 0)[-1]
    assert last_arrival > 0.1 and report["rates"][0]["duration_s"] > last_arrival
    _assert_png(tmp_path / "res" / "tiny.png")

    second = dict(report, label="other")
    (tmp_path / "other.json").write_text(json.dumps(second))
    combined = tmp_path / "both.png"
    assert sweep_plot.main([str(out), str(tmp_path / "other.json"), "-o", str(combined)]) == 0
    _assert_png(combined)


def test_rates_parsed_and_validated():
    assert sweep.parse_rates("1, 2,inf") == [1.0, 2.0, math.inf]
    for bad, why in [("0", "> 0"), ("-1", "> 0"), ("x", "not a number"), ("2,2", "twice"), ("", "at least")]:
        with pytest.raises(ValueError, match=why):
            sweep.parse_rates(bad)


def test_bad_inputs_exit_2(tmp_path, capsys):
    assert sweep.main(["--base-url", "http://127.0.0.1:1", "--workload", "w.jsonl", "--rates", "0"]) == 2
    assert "--rates" in capsys.readouterr().err
    (tmp_path / "x.json").write_text("{}")
    assert sweep_plot.main([str(tmp_path / "x.json"), "-o", str(tmp_path / "p.png")]) == 2
    assert "not a `kvserve bench sweep` result" in capsys.readouterr().err
    assert sweep_plot.main([str(tmp_path / "x.json"), "-o", str(tmp_path / "p.jpg")]) == 2
