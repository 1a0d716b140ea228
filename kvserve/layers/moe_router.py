"""Mixture-of-Experts routing: which k of E experts each token goes to, and with what weight.

- `select_experts`: softmax over the router logits, top-k, optionally renormalised (Qwen-MoE, Mixtral, OLMoE).
- `grouped_topk`: DeepSeek's. The experts are split into `num_groups` equal groups; each token first keeps its
  `topk_groups` best groups (a group scored by its best expert, or by the sum of its two best), then picks its
  k experts among theirs. DeepSeek-V2 scores with a softmax ("greedy": one group of all; "group_limited_greedy":
  groups scored by their max); DeepSeek-V3 ("noaux_tc") with a sigmoid, to which a learned
  `e_score_correction_bias` is added for the choice only: the weights are the uncorrected scores.
  The weights are scaled by `routed_scaling_factor` after any renormalisation.
- `GroupedTopKRouter`: DeepSeek's router layer (`gate`): its weight and the correction bias, logits in float32.

Follows transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter (v5.24) exactly, including what V2's ignores
(`norm_topk_prob`: its router never renormalises).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64): softmax in float32, the
    k largest, divided by their sum when `renormalize` (config `norm_topk_prob`; Mixtral always)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(frozen=True)
class GroupedTopK:
    """DeepSeek's routing rule (module docstring); `scoring` "softmax" (V2) or "sigmoid" (V3)."""

    top_k: int
    num_groups: int = 1
    topk_groups: int = 1
    scoring: str = "softmax"
    group_score: str = "max"
    """How a group is scored: "max" (its best expert: V2) or "top2_sum" (its two best: V3)."""
    renormalize: bool = False
    scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid") or self.group_score not in ("max", "top2_sum"):
            raise ValueError(f"unknown routing: scoring {self.scoring!r}, group score {self.group_score!r}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group {self.topk_groups} must be in [1, n_group {self.num_groups}]")


def grouped_topk(router_logits: torch.Tensor, rule: GroupedTopK, correction_bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] float32 -> (weights [T, k] float32, expert ids [T, k] int64) by `rule`;
    `correction_bias` [E] shifts the scores the experts are chosen by, not their weights."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if rule.scoring == "softmax" else logits.sigmoid()      # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    t, e = choice.shape
    if rule.num_groups > 1:
        if e % rule.num_groups:
            raise ValueError(f"{e} experts do not split into n_group {rule.num_groups} groups")
        grouped = choice.view(t, rule.num_groups, e // rule.num_groups)                  # [T, G, E/G]
        group_scores = (grouped.max(dim=-1).values if rule.group_score == "max"
                        else grouped.topk(2, dim=-1).values.sum(dim=-1))                 # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, torch.topk(group_scores, rule.topk_groups, dim=-1, sorted=False).indices, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(t, e)
        # NOTE: V2 zeroes the dropped experts' scores (softmax scores are positive), V3 sets them to -inf
        # (its corrected scores can be negative): the same choice as transformers wherever they differ.
        choice = choice.masked_fill(~keep, 0.0 if rule.scoring == "softmax" else float("-inf"))
    ids = torch.topk(choice, rule.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if rule.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * rule.scaling_factor, ids


def deepseek_rule(hf_config) -> GroupedTopK:
    """The routing rule of a DeepSeek-V2 (`topk_method` greedy / group_limited_greedy) or V3 (noaux_tc) config."""
    method = getattr(hf_config, "topk_method", None)
    v3 = getattr(hf_config, "model_type", "") == "deepseek_v3" or method == "noaux_tc"
    groups = int(getattr(hf_config, "n_group", None) or 1)
    topk_groups = int(getattr(hf_config, "topk_group", None) or groups)
    common = dict(top_k=hf_config.num_experts_per_tok, scaling_factor=float(hf_config.routed_scaling_factor))
    if v3:
        return GroupedTopK(num_groups=groups, topk_groups=topk_groups, scoring="sigmoid", group_score="top2_sum",
                           renormalize=bool(hf_config.norm_topk_prob), **common)
    if method in (None, "greedy"):
        return GroupedTopK(**common)
    if method == "group_limited_greedy":
        return GroupedTopK(num_groups=groups, topk_groups=topk_groups, **common)
    raise ValueError(f"DeepSeek topk_method {method!r} is not supported (greedy, group_limited_greedy, noaux_tc)")


class GroupedTopKRouter(nn.Module):
    """DeepSeek's router (`mlp.gate`): logits x W^T in float32, then `grouped_topk`. V3's
    `e_score_correction_bias` is a parameter here (a buffer in transformers) so that it loads like one."""

    keep_float32 = True
    """The router's weights stay float32 in a bfloat16 model, as transformers keeps them."""

    def __init__(self, hidden_size: int, num_experts: int, rule: GroupedTopK):
        super().__init__()
        self.rule = rule
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts), requires_grad=False)
                                        if rule.scoring == "sigmoid" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> router logits [T, E] float32."""
        return F.linear(x.float(), self.weight.float())

    def select(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) for FusedMoE."""
        return grouped_topk(router_logits, self.rule, self.e_score_correction_bias)

    def extra_repr(self) -> str:
        return f"experts={self.weight.shape[0]}, {self.rule}"
