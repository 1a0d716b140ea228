"""kvserve bench moe at tiny sizes: the table and JSON come out for every path, the paths agree with transformers,
and a path that disagrees fails the run before timing."""
from __future__ import annotations

import json
import os

import pytest

from kvserve.cli.main import build_parser
from kvserve.layers import moe_fused

TINY = ["bench", "moe", "--hidden-size", "64", "--intermediate-size", "32", "--num-experts", "8", "--top-k", "2",
        "--batch-sizes", "1,3", "--repeat", "2", "--stream-mib", "4", "--impls", "fused,sorted,reference"]


def _run(argv: list[str]) -> int:
    args = build_parser(argv).parse_args(argv)
    return args._run(args)


@pytest.mark.parametrize("flags", [[], ["--dtype", "bfloat16"], ["--quantization", "int8"]])
def test_tiny_layer_prints_every_path_against_transformers(flags, capsys):
    assert _run(TINY + flags + ["--json"]) == 0
    out = capsys.readouterr().out
    assert "MoE layer: hidden 64, intermediate 32, 8 experts, top-2" in out
    result = json.loads(out[out.index("{"):])
    assert [row["batch"] for row in result["rows"]] == [1, 3] and result["stream_gbps"] > 0
    for row in result["rows"]:
        assert 1 <= row["active_experts"] <= min(8, 2 * row["batch"])
        for name in ("fused", "sorted", "reference", "transformers"):
            assert row[name]["ms"] > 0 and row[name]["gbps"] > 0
        assert row["transformers"]["speedup_vs_transformers"] == 1.0
    bound = 3e-2 if "bfloat16" in flags else 1e-4
    assert all(v <= bound for k, v in result["agreement"].items() if "transformers" not in k)
    if "int8" in flags:  # against transformers' float weights: the quantization error, small but not zero
        assert 0 < result["agreement"]["fused vs transformers"] < 5e-2


@pytest.mark.skipif(not moe_fused.available(), reason="the fused MoE C++ kernel does not build here")
def test_a_path_that_disagrees_fails_before_timing(monkeypatch, capsys):
    real = moe_fused.experts_fused
    monkeypatch.setattr(moe_fused, "experts_fused", lambda *a, **k: real(*a, **k) * 1.01)
    assert _run(TINY) == 1
    out = capsys.readouterr().out
    assert "disagree" in out and "fused" in out and "MoE layer" not in out


def test_bad_flags_are_errors():
    with pytest.raises(ValueError, match="--impls"):
        _run(TINY[:-1] + ["fast"])
    with pytest.raises(ValueError, match="--batch-sizes"):
        _run(TINY + ["--batch-sizes", "0"])


@pytest.mark.skipif(not moe_fused.available(), reason="the fused MoE C++ kernel does not build here")
def test_baseline_kernel_is_timed_against_the_same_inputs(capsys):
    """--baseline FILE.cpp: another build of the expert kernel (here the current source: the cached build) runs on
    the layer's weights and routing, agrees, and every path gets its speed-up over it."""
    source = os.path.join(os.path.dirname(moe_fused.__file__), "csrc", "moe.cpp")
    assert _run(TINY + ["--baseline", source, "--json"]) == 0
    out = capsys.readouterr().out
    assert "vs baseline kernel: batch 1: fused" in out
    result = json.loads(out[out.index("{"):])
    assert result["agreement"]["baseline"] <= 1e-4
    for row in result["rows"]:
        assert row["baseline"]["speedup_vs_baseline"] == 1.0 and row["fused"]["speedup_vs_baseline"] > 0
    with pytest.raises(ValueError, match="--baseline: no such file"):
        _run(TINY + ["--baseline", source + ".missing"])
