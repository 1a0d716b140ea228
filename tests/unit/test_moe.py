"""layers/moe.py alone: the router, the expert-sorted and fused (C++) paths against the reference loop, int8
experts against their dequantized weights, and loading (per expert, stacked, and split over tensor-parallel
ranks)."""
from __future__ import annotations

import pytest
import torch

from kvserve.layers import moe_fused
from kvserve.layers.moe import (FusedMoE, experts_reference, experts_sorted, expert_params_mapping,
                                select_experts)
from kvserve.layers.quant.int8 import Int8WeightOnlyMethod

needs_kernel = pytest.mark.skipif(not moe_fused.available(), reason="the fused MoE C++ kernel does not build here")

E, K, H, I = 8, 2, 32, 24


def _experts(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(dtype)
    return w13, w2, g


def test_router_softmax_top_k_and_renormalisation():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 3.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids[0].tolist() == [3, 2] and sorted(ids[1].tolist()) == [0, 3]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    assert select_experts(logits.bfloat16(), 2, True)[0].dtype == torch.float32  # softmax in float32


@pytest.mark.parametrize("num_tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sorted_path_equals_reference(num_tokens, dtype):
    w13, w2, g = _experts(num_tokens, dtype)
    x = torch.randn(num_tokens, H, generator=g).to(dtype)
    # experts 6 and 7 never chosen: the sorted path must skip them without shifting the others' rows
    weights, ids = select_experts(torch.randn(num_tokens, E - 2, generator=g), K, renormalize=num_tokens % 2 == 0)
    want = experts_reference(x, w13, w2, weights, ids)
    got = experts_sorted(x, w13, w2, weights, ids)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)


def test_reference_is_the_per_token_definition():
    w13, w2, g = _experts(5)
    x = torch.randn(4, H, generator=g)
    weights, ids = select_experts(torch.randn(4, E, generator=g), K, renormalize=True)
    want = torch.zeros(4, H)
    for t in range(4):
        for w, e in zip(weights[t], ids[t]):
            gate, up = (w13[e] @ x[t]).chunk(2)
            want[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(experts_reference(x, w13, w2, weights, ids), want, atol=1e-6, rtol=1e-5)


def _load(layer: FusedMoE, tensors: dict[str, torch.Tensor]) -> None:
    for param, name, expert_id, shard_id in expert_params_mapping(E):
        if name in tensors:
            layer.weight_loader(param, tensors[name], expert_id, shard_id)


def _checkpoint(w13, w2) -> dict[str, torch.Tensor]:
    """The per-expert tensors a Hugging Face checkpoint holds for stacked w13 [E, 2I, H] and w2 [E, H, I]."""
    out = {}
    for e in range(E):
        out[f"experts.{e}.gate_proj.weight"] = w13[e, :I]
        out[f"experts.{e}.up_proj.weight"] = w13[e, I:]
        out[f"experts.{e}.down_proj.weight"] = w2[e]
    return out


@pytest.mark.parametrize("impl", ["sorted", "reference", "fused"])
def test_per_expert_and_stacked_checkpoints_load_the_same(impl):
    w13, w2, g = _experts(1)
    per_expert, stacked = FusedMoE(E, K, H, I, True, impl=impl), FusedMoE(E, K, H, I, True, impl=impl)
    _load(per_expert, _checkpoint(w13, w2))
    _load(stacked, {"experts.gate_up_proj": w13, "experts.down_proj": w2})
    assert torch.equal(per_expert.w13, w13) and torch.equal(per_expert.w2, w2)
    assert torch.equal(stacked.w13, w13) and torch.equal(stacked.w2, w2)
    x, logits = torch.randn(5, H, generator=g), torch.randn(5, E, generator=g)
    weights, ids = select_experts(logits, K, True)
    torch.testing.assert_close(per_expert(x, logits), experts_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("impl", ["sorted", "fused"])
@pytest.mark.parametrize("stacked", [False, True])
def test_tensor_parallel_shards_sum_to_the_whole_layer(stacked, impl):
    """Two ranks, each holding half of every expert's intermediate dimension: their outputs sum to one rank's."""
    w13, w2, g = _experts(2)
    tensors = {"experts.gate_up_proj": w13, "experts.down_proj": w2} if stacked else _checkpoint(w13, w2)
    whole = FusedMoE(E, K, H, I, False, impl="reference")
    _load(whole, tensors)
    ranks = [FusedMoE(E, K, H, I, False, tp_rank=r, tp_size=2, impl=impl) for r in range(2)]
    for rank in ranks:
        _load(rank, tensors)
        assert rank.w13.shape == (E, I, H) and rank.w2.shape == (E, H, I // 2)
    x, logits = torch.randn(7, H, generator=g), torch.randn(7, E, generator=g)
    torch.testing.assert_close(sum(rank(x, logits) for rank in ranks), whole(x, logits), atol=1e-6, rtol=1e-5)


def test_misshaped_expert_tensor_and_unknown_impl_are_errors(monkeypatch):
    layer = FusedMoE(E, K, H, I, True)
    with pytest.raises(ValueError, match=r"has shape \(24, 31\), expected \(24, 32\)"):
        layer.weight_loader("w13", torch.zeros(I, H - 1), 0, "w1")
    monkeypatch.setenv("KVSERVE_MOE_IMPL", "fast")
    with pytest.raises(ValueError, match="must be one of sorted, reference, fused"):
        FusedMoE(E, K, H, I, True)
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size 5"):
        FusedMoE(E, K, H, I, True, tp_size=5)


def test_fused_is_the_default(monkeypatch):
    monkeypatch.delenv("KVSERVE_MOE_IMPL", raising=False)
    assert FusedMoE(E, K, H, I, True).impl == "fused"


def _routing(g: torch.Generator, num_tokens: int, num_experts: int, top_k: int, used: int):
    """Random routing over the first `used` experts only (the rest stay empty)."""
    return select_experts(torch.randn(num_tokens, used, generator=g), top_k, renormalize=True)


@needs_kernel
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 17, 64])
@pytest.mark.parametrize("top_k", [1, 2, 6])
@pytest.mark.parametrize("shape", [(E, H, I), (10, 40, 16), (16, 64, 48)])  # H, I off and on the vector width
def test_fused_path_equals_reference(num_tokens, top_k, shape):
    """Every token's experts distinct but shared across tokens (rows per expert from 0 to num_tokens), 2 experts
    never chosen."""
    e, h, i = shape
    g = torch.Generator().manual_seed(num_tokens * 7 + top_k)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
    x = torch.randn(num_tokens, h, generator=g)
    weights, ids = _routing(g, num_tokens, e, top_k, e - 2)
    got = moe_fused.experts_fused(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, experts_reference(x, w13, w2, weights, ids), atol=1e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("num_tokens", [1, 9, 33])
def test_fused_path_in_bfloat16(num_tokens):
    """bfloat16 weights and activations, products in float32: within bfloat16 rounding of the float32 result
    (the reference rounds every intermediate to bfloat16: farther from it)."""
    w13, w2, g = _experts(num_tokens)
    x = torch.randn(num_tokens, H, generator=g)
    weights, ids = _routing(g, num_tokens, E, K, E)
    w13b, w2b, xb = w13.bfloat16(), w2.bfloat16(), x.bfloat16()
    got = moe_fused.experts_fused(xb, w13b, w2b, weights, ids)
    assert got.dtype == torch.bfloat16
    exact = experts_reference(xb.float(), w13b.float(), w2b.float(), weights, ids)
    torch.testing.assert_close(got.float(), exact, atol=4e-3, rtol=8e-3)
    torch.testing.assert_close(got, experts_reference(xb, w13b, w2b, weights, ids), atol=2e-2, rtol=2e-2)


def _int8_layer(impl: str, group: int, h: int = 64, i: int = 32, tp_size: int = 1) -> FusedMoE:
    layer = FusedMoE(E, K, h, i, True, impl=impl, method=Int8WeightOnlyMethod(group), tp_size=tp_size)
    g = torch.Generator().manual_seed(3)
    layer.w13.data.copy_(torch.randn(layer.w13.shape, generator=g) * 0.1)
    layer.w2.data.copy_(torch.randn(layer.w2.shape, generator=g) * 0.1)
    return layer


@pytest.mark.parametrize("impl", ["fused", "sorted", "reference"])
@pytest.mark.parametrize("group", [32, -1])
@pytest.mark.parametrize("num_tokens", [1, 2, 19])
def test_int8_experts_equal_the_reference_on_their_dequantized_weights(impl, group, num_tokens, monkeypatch):
    """--quantization int8: the experts quantized at load (the full-precision weights freed), and every path
    computes the experts of the dequantized weights (fixed-point inputs off: the next test)."""
    monkeypatch.setenv("KVSERVE_QUANT_FIXED_POINT", "0")
    layer = _int8_layer(impl, group)
    full13, full2 = layer.w13.detach().clone(), layer.w2.detach().clone()
    layer.process_weights_after_loading()
    assert layer.w13.numel() == 0 and layer.w2.numel() == 0 and layer.q13.dtype == torch.int8
    assert layer.s13.shape == (E, 2 * 32, 64 // (64 if group == -1 else group))
    w13, w2 = layer.int8[0].dequantized(), layer.int8[1].dequantized()
    for got, full in ((w13, full13), (w2, full2)):  # within half a code step of the loaded weights
        assert (got - full).abs().max() <= full.abs().max() / 254 + 1e-7
    g = torch.Generator().manual_seed(num_tokens)
    x, logits = torch.randn(num_tokens, 64, generator=g), torch.randn(num_tokens, E, generator=g)
    weights, ids = select_experts(logits, K, True)
    torch.testing.assert_close(layer(x, logits), experts_reference(x, w13, w2, weights, ids), atol=1e-6, rtol=1e-5)


def test_int8_experts_quantize_once_and_refuse_a_group_that_does_not_divide():
    layer = _int8_layer("fused", 32)
    layer.process_weights_after_loading()
    codes = layer.q13
    layer.process_weights_after_loading()  # a second call (a reload hook) keeps the codes
    assert layer.q13 is codes
    with pytest.raises(ValueError, match="group size 64 does not divide the expert input size 32"):
        FusedMoE(E, K, 64, 64, True, tp_size=2, method=Int8WeightOnlyMethod(64))
    assert FusedMoE(E, K, H, I, True, method=Int8WeightOnlyMethod(-1)).int8_group == -1  # any size per channel


def test_fused_falls_back_to_sorted_without_the_kernel(monkeypatch):
    w13, w2, g = _experts(4)
    layer = FusedMoE(E, K, H, I, True, impl="fused")
    _load(layer, {"experts.gate_up_proj": w13, "experts.down_proj": w2})
    x, logits = torch.randn(6, H, generator=g), torch.randn(6, E, generator=g)
    monkeypatch.setattr(moe_fused, "available", lambda: False)
    weights, ids = select_experts(logits, K, True)
    torch.testing.assert_close(layer(x, logits), experts_sorted(x, w13, w2, weights, ids), atol=0, rtol=0)


@pytest.mark.parametrize("impl", ["fused", "sorted"])
def test_int8_tensor_parallel_shards_sum_to_the_whole_layer(impl):
    """int8 groups of 32 never straddle a rank's columns (I / tp = 32): each rank's codes and scales are the
    whole layer's slices, so two ranks' outputs sum to one int8 rank's."""
    g = torch.Generator().manual_seed(6)
    w13, w2 = torch.randn(E, 2 * 64, 64, generator=g) * 0.1, torch.randn(E, 64, 64, generator=g) * 0.1
    tensors = {"experts.gate_up_proj": w13, "experts.down_proj": w2}
    layers = [FusedMoE(E, K, 64, 64, False, tp_rank=r, tp_size=tp, impl=impl, method=Int8WeightOnlyMethod(32))
              for tp, r in ((1, 0), (2, 0), (2, 1))]
    for layer in layers:
        _load(layer, tensors)
        layer.process_weights_after_loading()
    x, logits = torch.randn(9, 64, generator=g), torch.randn(9, E, generator=g)
    whole, *ranks = (layer(x, logits) for layer in layers)
    torch.testing.assert_close(sum(ranks), whole, atol=1e-5, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("group", [32, 64, -1])
@pytest.mark.parametrize("num_tokens", [1, 2, 3])
def test_int8_fixed_point_inputs_at_one_or_two_tokens(group, num_tokens, monkeypatch):
    """The fused path's int8 experts at one or two tokens round their inputs (x, then SiLU * up) to 16-bit fixed
    point per 32 columns, as the dense int8 kernels do: within 2^-15 of each run's largest |input| per product, so
    the outputs stay within 1e-4 of the float path's; from three tokens on (or with KVSERVE_QUANT_FIXED_POINT=0)
    the float path runs alone."""
    layers = {}
    for env in ("1", "0"):
        monkeypatch.setenv("KVSERVE_QUANT_FIXED_POINT", env)
        layers[env] = _int8_layer("fused", group, i=64)
        layers[env].process_weights_after_loading()
    g = torch.Generator().manual_seed(num_tokens)
    x, logits = torch.randn(num_tokens, 64, generator=g), torch.randn(num_tokens, E, generator=g)
    fixed, exact = layers["1"](x, logits), layers["0"](x, logits)
    torch.testing.assert_close(fixed, exact, atol=1e-4 * exact.abs().max().item(), rtol=0)
    assert torch.equal(fixed, exact) == (num_tokens > moe_fused.fixed_tokens())


@needs_kernel
@pytest.mark.parametrize("dtype,num_tokens,fused", [
    (torch.float32, 255, True), (torch.float32, 256, False),      # 64 rows per expert: E 8, k 2
    (torch.bfloat16, 63, True), (torch.bfloat16, 64, False)])     # 16
def test_fused_hands_prefill_sized_batches_to_the_sorted_path(dtype, num_tokens, fused, monkeypatch):
    """From moe_fused.MAX_ROWS_PER_EXPERT expected rows per expert (BF16_MAX_ROWS_PER_EXPERT for bfloat16
    weights) a dense matmul per expert runs; either way the result is the reference's."""
    w13, w2, g = _experts(9, dtype)
    layer = FusedMoE(E, K, H, I, True, impl="fused").to(dtype)
    _load(layer, {"experts.gate_up_proj": w13, "experts.down_proj": w2})
    assert layer.w13.dtype == dtype
    calls = []
    real = moe_fused.experts_fused
    monkeypatch.setattr(moe_fused, "experts_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, logits = torch.randn(num_tokens, H, generator=g).to(dtype), torch.randn(num_tokens, E, generator=g)
    weights, ids = select_experts(logits, K, True)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(layer(x, logits), experts_reference(x, w13, w2, weights, ids), **tol)
    assert bool(calls) == fused
