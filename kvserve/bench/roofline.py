"""Roofline line for the offline bench: the machine's fp32 matmul rate at the model's layer shapes, and the
rate kvserve achieved on a workload (useful model FLOPs / wall time).

Model FLOPs counted: 2 x non-embedding linear parameters per token processed (prompt + generated), the LM
head (2 x hidden x vocab) per generated token, and attention (QK^T and PV: 4 x layers x heads x head_dim
per (query, key) pair, causal). Recomputation after preemption and padding are not useful work and are not
counted, so the fraction is an honest efficiency; nor are the prompt tokens a request took from the prefix
cache (`cached`: their linears and their own attention rows were never run), which would otherwise put a
shared-prefix workload far above 100%.
"""
from __future__ import annotations

import time

import torch

from kvserve.bench.workload import WorkloadRequest


def _layer_shapes(cfg) -> list[tuple[int, int]]:
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]  # (out, in): qkv, o, gate_up, down


def workload_flops(cfg, requests: list[WorkloadRequest], cached: list[int] | None = None) -> float:
    """Model FLOPs of `requests`; cached[i]: prompt tokens request i took from the prefix cache (default none)."""
    linear_params = cfg.num_hidden_layers * sum(o * i for o, i in _layer_shapes(cfg))
    attn_per_pair = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    total = 0.0
    for r, h in zip(requests, cached or [0] * len(requests)):
        n = len(r.prompt_token_ids) + r.max_tokens
        total += 2 * linear_params * (n - h) + 2 * cfg.hidden_size * cfg.vocab_size * r.max_tokens
        total += attn_per_pair * (n * (n + 1) - h * (h + 1)) / 2   # query positions h..n-1, each seeing j + 1 keys
    return total


def measure_matmul_rate(cfg, num_tokens: int = 512, reps: int = 20) -> float:
    """GFLOP/s of one decoder layer's four projections at num_tokens rows, with the faster of F.linear
    and oneDNN-prepacked weights (what kvserve uses on CPU)."""
    from kvserve.layers.linear import ReplicatedLinear
    from kvserve.layers.linear_methods import DenseMethod, OneDNNPackedMethod

    shapes = _layer_shapes(cfg)
    xs = [torch.randn(num_tokens, i) for _, i in shapes]
    methods = [DenseMethod()] + ([OneDNNPackedMethod()] if OneDNNPackedMethod.available() else [])
    candidates = []
    for method in methods:
        layers = []
        for o, i in shapes:
            layer = ReplicatedLinear(i, o, False, method)
            layer.weight.data.normal_()
            layer.process_weights_after_loading()
            layers.append(layer)
        candidates.append(layers)
    flops = sum(2 * num_tokens * o * i for o, i in shapes)
    best = 0.0
    with torch.inference_mode():
        for fns in candidates:
            for _ in range(3):
                [f(x) for f, x in zip(fns, xs)]
            start = time.perf_counter()
            for _ in range(reps):
                [f(x) for f, x in zip(fns, xs)]
            best = max(best, flops * reps / (time.perf_counter() - start))
    return best / 1e9
