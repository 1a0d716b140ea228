"""`kvserve bench playbook` on a tiny checkpoint with the tiny preset: every row is present with its claim,
its figures (or why there are none) and the command that reproduces it. Nothing is timed here."""
from __future__ import annotations

import json

import pytest

from kvserve.bench.playbook import ROW_KEYS, main, run_playbook
from kvserve.bench.playbook_presets import PRESETS
from kvserve.bench.playbook_report import MEASURED, NOT_MEASURABLE
from kvserve.config import EngineArgs

# Two halves, each a few seconds: the engine's scheduling and caching rows, then the model-work rows.
_HALVES = [ROW_KEYS[:ROW_KEYS.index("spec-ngram")], ROW_KEYS[ROW_KEYS.index("spec-ngram"):]]


@pytest.mark.parametrize("keys", _HALVES, ids=["scheduling-and-caching", "model-work"])
def test_every_row_is_reported_with_claim_figures_and_command(tiny_llama, keys):
    path, _ = tiny_llama
    args = EngineArgs(model=path, max_model_len=256, num_gpu_blocks_override=128)
    rows = run_playbook(args, PRESETS["tiny"], list(keys), draft_model=path, log=lambda line: None)
    by_key = {r.key: r for r in rows}
    assert list(by_key) == list(keys)
    for r in rows:
        assert r.claim, r.key
        if r.key == "medusa-eagle":
            assert r.status == NOT_MEASURABLE and r.headline is None and r.note
            continue
        assert r.command.startswith(f"kvserve bench playbook --preset tiny --rows {r.key} "), r.command
        assert f"--model {path}" in r.command
        if r.key == "batch-invariance":
            assert "--batch-invariant" in r.command and r.details["alone_equals_batched"], r.command
        assert r.status == MEASURED, (r.key, r.status, r.note)
        assert r.headline is not None and r.headline == r.headline and r.details, r.key
    # the baselines' switches give the same tokens as the default engine
    if "continuous-batching" in by_key:
        assert by_key["continuous-batching"].details["identical_outputs"] == PRESETS["tiny"].varied_requests
        paged = by_key["paged-attention"].details
        assert paged["contiguous_peak_requests"] == PRESETS["tiny"].paged_slabs < paged["paged_peak_requests"]
    else:
        assert by_key["spec-ngram"].details["identical_outputs"] and by_key["spec-draft"].details["identical_outputs"]


def test_cli_writes_json_and_plot(tiny_llama, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, _ = tiny_llama
    report, png = tmp_path / "playbook.json", tmp_path / "playbook.png"
    rc = main(["--preset", "tiny", "--rows", "continuous-batching,spec-draft,medusa-eagle", "--model", path,
               "--max-model-len", "256", "--json", str(report), "--plot", str(png)])
    assert rc == 0
    data = json.loads(report.read_text())
    assert [r["key"] for r in data["rows"]] == ["continuous-batching", "spec-draft", "medusa-eagle"]
    assert data["meta"]["preset"] == "tiny" and data["meta"]["model"] == path
    assert data["rows"][1]["status"] == "not measured" and "--draft-model PATH" in data["rows"][1]["command"]
    assert png.stat().st_size > 0
    out = capsys.readouterr().out
    assert "continuous vs static batching" in out and "4-10x throughput" in out and "reproduce: kvserve" in out


@pytest.mark.parametrize("argv, message", [
    (["--rows", "warp-drive"], "--rows: unknown row(s) warp-drive; choose from continuous-batching"),
    (["--quick", "--preset", "full"], "--quick is --preset quick; it cannot be combined with --preset full"),
    (["--plot", "chart.svg"], "--plot must be a .png file, got 'chart.svg'"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
