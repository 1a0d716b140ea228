"""kvserve bench quality: the metrics against exact values on small distributions, and an end-to-end run on a
tiny checkpoint (the reference against itself agrees everywhere)."""
from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from kvserve.bench.quality import Distributions, add_arguments, compare, run, settings


def _dists(logits: np.ndarray, targets: list[int], k: int) -> Distributions:
    lps = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    order = np.argsort(-lps, axis=1)[:, :k]
    return Distributions([o for o in order], [lp[o] for lp, o in zip(lps, order)],
                         np.array([lp[t] for lp, t in zip(lps, targets)]), 0.0)


def test_metrics_equal_exact_values_when_top_k_covers_the_vocabulary():
    rng = np.random.default_rng(0)
    p_logits = rng.normal(size=(50, 8)) * 2
    q_logits = p_logits + rng.normal(size=(50, 8)) * 0.5
    targets = rng.integers(0, 8, size=50).tolist()
    ref, other = _dists(p_logits, targets, 8), _dists(q_logits, targets, 8)
    same = compare(ref, ref)
    assert same["top1_agreement"] == 1.0 and same["mean_kl"] == pytest.approx(0.0, abs=1e-12)
    assert same["perplexity_ratio"] == pytest.approx(1.0)
    got = compare(ref, other)
    p = np.exp(p_logits) / np.exp(p_logits).sum(1, keepdims=True)
    q = np.exp(q_logits) / np.exp(q_logits).sum(1, keepdims=True)
    assert got["mean_kl"] == pytest.approx(float(np.mean(np.sum(p * np.log(p / q), axis=1))), rel=1e-9)
    assert got["top1_agreement"] == pytest.approx(float(np.mean(p.argmax(1) == q.argmax(1))))
    lp_q = np.log(q[np.arange(50), targets])
    assert got["perplexity"] == pytest.approx(math.exp(-lp_q.mean()))


def test_truncated_kl_is_a_lower_bound_and_sees_a_perturbation():
    rng = np.random.default_rng(1)
    p_logits = rng.normal(size=(40, 32)) * 3
    q_logits = p_logits + rng.normal(size=(40, 32))
    targets = [0] * 40
    exact = compare(_dists(p_logits, targets, 32), _dists(q_logits, targets, 32))["mean_kl"]
    approx = compare(_dists(p_logits, targets, 6), _dists(q_logits, targets, 6))["mean_kl"]
    assert 0 < approx <= exact * 1.05


def test_end_to_end_on_a_tiny_checkpoint(tiny_llama, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join('{"id": "%d", "prompt_token_ids": %s, "max_tokens": 1}\n' % (i, list(range(5 + i, 60 + 7 * i)))
                            for i in range(3)))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", tiny_llama[0], "--workload", str(path), "--quantization", "",
                              "--top-k", "8", "--chunk", "16", "--num-gpu-blocks-override", "256"])
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "3 prompts, 180 positions" in out and "reference" in out and "100.00%" in out


def test_a_quantization_setting_may_carry_a_model_dtype():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--quantization", "int8,int8+bfloat16", "--dtype", "bfloat16"])
    assert settings(args) == [("reference", {}), ("--quantization int8", {"quantization": "int8"}),
                              ("--quantization int8 --dtype bfloat16", {"quantization": "int8", "dtype": "bfloat16"}),
                              ("--dtype bfloat16", {"dtype": "bfloat16"})]
