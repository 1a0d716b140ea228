"""The weight-streaming figure (bench/streaming.py): the bytes one decode token reads, counted from the loaded model
against a hand count from the config, and the fraction's arithmetic."""
from __future__ import annotations

import pytest

from kvserve.bench.streaming import StreamingFigure, model_bytes_per_token


def _linear_params(cfg) -> tuple[int, int]:
    """(decoder layers' linear weights, LM head weights) of a Llama config."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = (q + 2 * kv) * h + h * q + 2 * i * h + h * i
    return cfg.num_hidden_layers * per_layer, cfg.vocab_size * h


@pytest.mark.parametrize("tie", [False, True])
def test_fp32_counts_every_linear_and_the_head_not_the_embedding(tiny_checkpoint, tie):
    path, hf = tiny_checkpoint("llama", tie=tie)
    layers, head = _linear_params(hf.config)
    assert model_bytes_per_token(["--model", path, "--dtype", "float32"]) == 4 * (layers + head)


def test_int8_counts_codes_and_scales_not_the_dense_weight(tiny_llama):
    """int8 group 32: a byte per weight and a float32 scale per 32 of them; the head likewise (group 32)."""
    path, hf = tiny_llama
    layers, head = _linear_params(hf.config)
    want = (layers + head) * (1 + 4 / 32)
    assert model_bytes_per_token(["--model", path, "--quantization", "int8", "--port", "0"]) == want


def test_fraction_of_the_limit():
    figure = StreamingFigure(tok_s=30.0, bytes_per_token=500_000_000, read_gbps=20.0)
    assert figure.limit_tok_s == pytest.approx(40.0)
    assert figure.fraction == pytest.approx(0.75)
    assert "75% of the weight-streaming limit" in figure.describe()
    assert figure.as_dict()["limit_tok_s"] == pytest.approx(40.0)
