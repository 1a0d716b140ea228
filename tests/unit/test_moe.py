"""layers/moe.py alone: the router, the expert-sorted path against the reference loop, and loading (per expert,
stacked, and split over tensor-parallel ranks)."""
from __future__ import annotations

import pytest
import torch

from kvserve.layers.moe import (FusedMoE, experts_reference, experts_sorted, expert_params_mapping,
                                select_experts)

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


@pytest.mark.parametrize("impl", ["sorted", "reference"])
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


@pytest.mark.parametrize("stacked", [False, True])
def test_tensor_parallel_shards_sum_to_the_whole_layer(stacked):
    """Two ranks, each holding half of every expert's intermediate dimension: their outputs sum to one rank's."""
    w13, w2, g = _experts(2)
    tensors = {"experts.gate_up_proj": w13, "experts.down_proj": w2} if stacked else _checkpoint(w13, w2)
    whole = FusedMoE(E, K, H, I, False)
    _load(whole, tensors)
    ranks = [FusedMoE(E, K, H, I, False, tp_rank=r, tp_size=2) for r in range(2)]
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
    with pytest.raises(ValueError, match="must be one of sorted, reference"):
        FusedMoE(E, K, H, I, True)
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size 5"):
        FusedMoE(E, K, H, I, True, tp_size=5)
