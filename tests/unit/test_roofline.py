"""The roofline's model-FLOP count, against a hand computation."""
from __future__ import annotations

from types import SimpleNamespace

from kvserve.bench.roofline import workload_flops
from kvserve.bench.workload import WorkloadRequest


def test_workload_flops_by_hand():
    cfg = SimpleNamespace(num_attention_heads=2, num_key_value_heads=1, head_dim=4, hidden_size=8,
                          intermediate_size=16, num_hidden_layers=3, vocab_size=100)
    # per layer: qkv 16x8, o 8x8, gate_up 32x8, down 8x16 = 128 + 64 + 256 + 128 = 576 weights
    req = WorkloadRequest("r", [1, 2, 3], max_tokens=2)
    n = 5
    linear = 2 * 3 * 576 * n
    head = 2 * 8 * 100 * 2
    attention = 4 * 3 * 2 * 4 * (n * (n + 1) / 2)
    assert workload_flops(cfg, [req]) == linear + head + attention


def test_prompt_tokens_from_the_prefix_cache_are_not_counted():
    """A request whose first 2 prompt tokens came from the cache ran its linears on 3 of its 5 tokens and the
    attention of query positions 2..4 only (each still sees every earlier key)."""
    cfg = SimpleNamespace(num_attention_heads=2, num_key_value_heads=1, head_dim=4, hidden_size=8,
                          intermediate_size=16, num_hidden_layers=3, vocab_size=100)
    req = WorkloadRequest("r", [1, 2, 3], max_tokens=2)
    linear = 2 * 3 * 576 * 3
    head = 2 * 8 * 100 * 2
    attention = 4 * 3 * 2 * 4 * (3 + 4 + 5)
    assert workload_flops(cfg, [req], [2]) == linear + head + attention
    assert workload_flops(cfg, [req, req], [0, 2]) == workload_flops(cfg, [req]) + linear + head + attention
