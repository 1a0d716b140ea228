"""layers/moe_router.py against transformers' own DeepSeek router modules (v5.24: DeepseekV2TopkRouter,
DeepseekV3TopkRouter) on random weights, correction biases and hidden states: the same experts per token, the
same weights; and the rules' edges (a group count that does not divide, an unknown topk_method)."""
from __future__ import annotations

import pytest
import torch

from kvserve.layers.moe_router import GroupedTopK, GroupedTopKRouter, deepseek_rule, grouped_topk, select_experts

H, E = 32, 16


def _config(version: int, **kw):
    import transformers as tf

    common = dict(hidden_size=H, n_routed_experts=E, num_experts_per_tok=kw.pop("k", 4), num_hidden_layers=1,
                  num_attention_heads=4, vocab_size=64)
    cls = tf.DeepseekV2Config if version == 2 else tf.DeepseekV3Config
    return cls(**common, **kw)


def _hf_router(cfg, seed: int, bias_std: float):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
        DeepseekV2TopkRouter,
    )
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3TopkRouter,
    )

    router = (DeepseekV3TopkRouter if cfg.model_type == "deepseek_v3" else DeepseekV2TopkRouter)(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * bias_std)
    return router


def _ours(cfg, hf) -> GroupedTopKRouter:
    router = GroupedTopKRouter(H, E, deepseek_rule(cfg))
    with torch.no_grad():
        router.weight.copy_(hf.weight)
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    return router


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(-1)
    return ids.gather(1, order), weights.gather(1, order)


CASES = [
    (2, dict(topk_method="greedy", routed_scaling_factor=1.0)),
    (2, dict(topk_method="greedy", routed_scaling_factor=16.0, norm_topk_prob=True)),  # V2 never renormalises
    (2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5)),
    (2, dict(topk_method="group_limited_greedy", n_group=8, topk_group=1, k=2, routed_scaling_factor=1.0)),
    (3, dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    (3, dict(n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=False)),
    (3, dict(n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, k=8)),
]


@pytest.mark.parametrize(("version", "kw"), CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_routing_matches_transformers_router(version, kw, seed):
    cfg = _config(version, **kw)
    hf = _hf_router(cfg, seed, bias_std=0.5)
    ours = _ours(cfg, hf)
    x = torch.randn(97, H, generator=torch.Generator().manual_seed(100 + seed))
    with torch.no_grad():
        logits, hf_weights, hf_ids = hf(x)
        got_logits = ours.forward(x)
        weights, ids = ours.select(got_logits)
    torch.testing.assert_close(got_logits, logits)
    want_ids, want_w = _by_expert(hf_weights, hf_ids)
    got_ids, got_w = _by_expert(weights, ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)
    assert weights.dtype == torch.float32


def test_correction_bias_chooses_but_does_not_weigh():
    """V3: a large bias on expert 0 makes every token choose it, with its uncorrected sigmoid score."""
    rule = GroupedTopK(top_k=2, scoring="sigmoid", group_score="top2_sum", num_groups=2, topk_groups=1)
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    bias = torch.zeros(8)
    bias[0] = 10.0
    weights, ids = grouped_topk(logits, rule, bias)
    assert (ids == 0).any(dim=-1).all()
    torch.testing.assert_close(weights, logits.sigmoid().gather(1, ids))
    _, plain = grouped_topk(logits, rule)
    assert not torch.equal(ids.sort(-1).values, plain.sort(-1).values)


def test_groups_restrict_the_choice():
    """Group-limited: with one group kept of four, both experts come from the group holding the best expert."""
    rule = GroupedTopK(top_k=2, num_groups=4, topk_groups=1)
    logits = torch.randn(50, 16, generator=torch.Generator().manual_seed(1))
    _, ids = grouped_topk(logits, rule)
    assert (ids // 4 == (logits.argmax(-1) // 4)[:, None]).all()


def test_greedy_is_softmax_top_k_scaled():
    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(2))
    weights, ids = grouped_topk(logits, GroupedTopK(top_k=3, scaling_factor=2.0))
    want_w, want_ids = select_experts(logits, 3, renormalize=False)
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    torch.testing.assert_close(weights.sort(-1).values, (want_w * 2.0).sort(-1).values)


def test_bad_rules_are_named():
    with pytest.raises(ValueError, match="do not split into n_group 3"):
        grouped_topk(torch.randn(2, 16), GroupedTopK(top_k=2, num_groups=3, topk_groups=1))
    with pytest.raises(ValueError, match="topk_group 5"):
        GroupedTopK(top_k=2, num_groups=4, topk_groups=5)
    cfg = _config(2, topk_method="greedy")
    cfg.topk_method = "mystery"
    with pytest.raises(ValueError, match="topk_method 'mystery'"):
        deepseek_rule(cfg)
