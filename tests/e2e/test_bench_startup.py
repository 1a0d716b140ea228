"""`kvserve bench startup`: one fresh `kvserve serve` of the built-in model, end to end, every phase printed; its
flag handling and summary in isolation."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kvserve.bench import startup as bench
from kvserve.config import EngineArgs
from kvserve.model_loader.gguf_loader import builtin_model_path


def test_one_start_of_the_builtin_model_prints_every_phase():
    try:
        builtin_model_path()
    except ModuleNotFoundError as exc:
        pytest.skip(str(exc))
    out = subprocess.run([sys.executable, "-m", "kvserve.cli.main", "bench", "startup", "--repeat", "1",
                          "--timeout", "240"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {m.group(1).strip(): m.group(2) for m in re.finditer(r"^([a-z][a-z -]*?)\s+(\d+\.\d+|-)\s", out.stdout, re.M)}
    for name in (*bench.PHASES, *bench.OUTSIDE):
        assert name in rows, (name, out.stdout)
    measured = {name: float(v) for name, v in rows.items() if v != "-"}
    for name in ("import", "tokenizer", "config", "weights", "kernels", "ready", "health", "first token"):
        assert name in measured, (name, out.stdout)
    assert 0 < measured["import"] < measured["ready"] <= measured["health"] + 0.5 < measured["first token"] + 0.5
    assert "ISA " in out.stdout


def test_serve_flags_give_back_the_engine_args():
    parser = bench.argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = ["--model", "/m.gguf", "--dtype", "bfloat16", "--quantization", "gguf", "--no-enable-prefix-caching",
            "--max-num-seqs", "8"]
    args = parser.parse_args(["--repeat", "2", *argv])
    engine_args = EngineArgs.from_cli(args)
    flags = bench.serve_flags(engine_args)
    assert sorted(flags) == sorted(argv)
    assert EngineArgs.from_cli(parser.parse_args(flags)) == engine_args
    assert bench.serve_flags(EngineArgs()) == []


def test_bad_arguments_exit_2(capsys):
    assert bench.main(["--repeat", "0"]) == 2
    assert "--repeat must be >= 1" in capsys.readouterr().err


def test_summary_and_table_over_runs():
    runs = [bench.StartupRun({"import": 1.0, "weights": 2.0, "ready": 4.0}, {"health": 4.2, "first token": 4.5}),
            bench.StartupRun({"import": 3.0, "weights": 1.0, "ready": 6.0}, {"health": 6.1, "first token": 6.4}),
            bench.StartupRun({}, {"health": 5.0, "first token": 5.5})]  # a server without the startup line
    assert bench.summarize(runs) == {"import": 2.0, "weights": 1.5, "ready": 5.0, "health": 5.0, "first token": 5.5}
    table = bench.format_table(runs, ["kvserve", "serve"], "avx2")
    assert re.search(r"^warm-up\s+-\s+-\s+-$", table, re.M)  # a phase no run reported
    assert re.search(r"^import\s+2\.00\s+1\.00\s+3\.00$", table, re.M)
