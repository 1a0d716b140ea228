"""DeepSeek-V2 / DeepSeek-V3 decoder over a flattened, paged batch: Multi-head Latent Attention over a latent KV
cache (attention/mla.py) and DeepSeek's Mixture-of-Experts (grouped top-k routing: layers/moe_router.py; shared
experts added unscaled); the first `first_k_dense_replace` layers have a dense MLP.

Follows transformers' modeling_deepseek_v2 / modeling_deepseek_v3 (v5.24):
- q: q_proj, or (q_lora_rank set) q_a_proj -> q_a_layernorm -> q_b_proj; [H, qk_nope_head_dim + qk_rope_head_dim].
- kv_a_proj_with_mqa -> c_kv [kv_lora_rank] (kv_a_layernorm) and k_pe [qk_rope_head_dim], shared by the heads;
  kv_b_proj maps c_kv to each head's k_nope and v. The cache stores c_kv ++ roped k_pe.
- RoPE on the rope dims only, on interleaved pairs (x0, x1), (x2, x3)... (V2 always, V3 with rope_interleave),
  else rotate-half; the rotated dims come out de-interleaved (V3's layout: V2's own is a fixed permutation of
  it, the same for q and k, so every score is the same). The softmax scale is qk_head_dim^-0.5 times yarn's
  mscale(factor, mscale_all_dim)^2 for a scaled RoPE.
- The two q/kv latent norms use eps 1e-6 (transformers builds them without the config's rms_norm_eps).

Tensor parallelism splits the attention heads (MLAttention), the experts' and MLPs' intermediate dimension, the
vocabulary; each rank holds the whole latent cache.
"""
from __future__ import annotations

import math
import re

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.mla import mla_decode, mla_prefill, write_latent
from kvserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from kvserve.layers.linear_methods import DenseMethod, LinearMethod
from kvserve.layers.moe import FusedMoE
from kvserve.layers.moe_router import GroupedTopKRouter, deepseek_rule
from kvserve.layers.parallel import ShardContext
from kvserve.model_loader.architectures import ArchFeatures, num_experts
from kvserve.models.layer_ops import LayerOps
from kvserve.models.llama import MLP, LlamaForCausalLM, RMSNorm

_LATENT_NORM_EPS = 1e-6
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def softmax_scale(cfg) -> float:
    """qk_head_dim^-0.5, times mscale^2 with yarn's mscale(factor, mscale_all_dim) where the RoPE is scaled."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, H, R] at the step's positions; cos/sin [T, R] (the two halves equal: llama.RotaryEmbedding)."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLAttention(nn.Module):
    """Tensor parallelism splits the heads: q_proj / q_b_proj and kv_b_proj column-parallel (their rows are
    head-major), o_proj row-parallel; the latent projections, their norms and so the cache are whole on every
    rank."""

    def __init__(self, cfg, method: LinearMethod, shard: ShardContext):
        super().__init__()
        heads = cfg.num_attention_heads
        if heads % shard.size:
            raise ValueError(f"tensor_parallel_size {shard.size} does not divide {heads} attention heads")
        self.num_heads = heads // shard.size                                   # this rank's
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.latent_dim = self.kv_lora_rank + self.rope_dim
        """The cache's vector per token (worker.kv_cache_spec reads it)."""
        qk = self.nope + self.rope_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        h, tp = cfg.hidden_size, (shard.rank, shard.size)
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, heads * qk, False, method, *tp)
        else:
            self.q_a_proj = ReplicatedLinear(h, self.q_lora_rank, bias, method)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk, False, method, *tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.latent_dim, bias, method)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        # NOTE: always dense: its weight is read as W_UK / W_UV by the absorbed decode
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope + self.v_dim), False,
                                              DenseMethod(), *tp)
        self.o_proj = RowParallelLinear(heads * self.v_dim, h, bias, method, *tp, shard.all_reduce)
        self.scale = softmax_scale(cfg)
        self.interleaved = getattr(cfg, "model_type", "") == "deepseek_v2" or bool(getattr(cfg, "rope_interleave",
                                                                                             True))

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        q = (self.q_proj.forward(x) if self.q_lora_rank is None else
             self.q_b_proj.forward(self.q_a_layernorm(self.q_a_proj.forward(x))))
        return q.view(x.shape[0], self.num_heads, self.nope + self.rope_dim)  # [T, H, nope + R]

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight as W_UK [H, nope, L] and W_UV [H, v, L] (views)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope], w[:, self.nope:]

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached vectors [S, L + R] -> per-head keys [S, H, nope + R] and values [S, H, v]."""
        s = latent.shape[0]
        kv = self.kv_b_proj.forward(latent[:, :self.kv_lora_rank]).view(s, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = latent[:, None, self.kv_lora_rank:].expand(s, self.num_heads, self.rope_dim)
        return torch.cat((k_nope, k_pe), dim=-1), v

    def forward(self, x, rope_cos_sin, kv_cache, attn_meta, ops: LayerOps) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = rope_cos_sin
        q = self._queries(x)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin, self.interleaved)
        c_kv, k_pe = self.kv_a_proj_with_mqa.forward(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(1), cos, sin, self.interleaved).squeeze(1)           # [T, R]
        latent = torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)                          # [T, L + R]
        flat = write_latent(kv_cache, attn_meta.slot_mapping, latent)
        out = x.new_empty(t, self.num_heads, self.v_dim)                                       # [T, H, v]
        nd = attn_meta.num_decode_tokens
        if nd:
            w_uk, w_uv = self._w_uk_uv()
            q_latent = torch.einsum("thn,hnl->thl", q_nope[:nd], w_uk)                         # [Bd, H, L]
            o_latent = mla_decode(torch.cat((q_latent, q_pe[:nd]), dim=-1), flat, attn_meta, self.scale,
                                  self.kv_lora_rank)                                           # [Bd, H, L]
            out[:nd] = torch.einsum("thl,hvl->thv", o_latent, w_uv)
        if attn_meta.prefills:
            mla_prefill(torch.cat((q_nope, q_pe), dim=-1), latent, flat, attn_meta.prefills, out, self.scale,
                        self.expand)
        return self.o_proj.forward(out.view(t, -1))


class DeepseekMoE(nn.Module):
    """Routed experts (grouped top-k) plus `n_shared_experts` experts' worth of a dense MLP every token takes."""

    def __init__(self, cfg, method: LinearMethod, shard: ShardContext):
        super().__init__()
        experts, width = num_experts(cfg), cfg.moe_intermediate_size
        self.gate = GroupedTopKRouter(cfg.hidden_size, experts, deepseek_rule(cfg))
        self.experts = FusedMoE(experts, cfg.num_experts_per_tok, cfg.hidden_size, width, False, shard.rank,
                                shard.size, shard.all_reduce, method=method)
        # NOTE: transformers builds (and saves) the shared MLP even with n_shared_experts 0: zero-width tensors,
        # loaded and never run (dense: a packed or quantized method takes no empty weight)
        shared = getattr(cfg, "n_shared_experts", None)
        self.shared_experts = (MLP(cfg.hidden_size, width * shared, method if shared else DenseMethod(), shard)
                               if shared is not None else None)
        self.has_shared = bool(shared)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        out = self.experts.forward(x, self.gate.forward(x), ops.silu_and_mul, select=self.gate.select)
        if self.has_shared:
            out = out + self.shared_experts.forward(x, ops)
        return out


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg, method: LinearMethod, shard: ShardContext, sparse: bool):
        super().__init__()
        if getattr(cfg, "mlp_bias", False):
            raise ValueError("DeepSeek-V2 with mlp_bias (biased MLP projections) is not supported yet")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, method, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (DeepseekMoE(cfg, method, shard) if sparse
                    else MLP(cfg.hidden_size, cfg.intermediate_size, method, shard))

    def forward(self, x, residual, rope_cos_sin, kv_cache, attn_meta, ops: LayerOps):
        """(sublayer output, residual stream) in and out, the residual add fused into each norm (llama.py)."""
        norm = self.input_layernorm
        x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        x = self.self_attn.forward(x, rope_cos_sin, kv_cache, attn_meta, ops)
        norm = self.post_attention_layernorm
        x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.mlp.forward(x, ops), residual


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM: llama.LlamaForCausalLM (embeddings, final norm, the RoPE
    tables, LM head, forward) with DeepSeek's decoder layers."""

    @staticmethod
    def make_layer(cfg, feats: ArchFeatures, backend: AttentionBackend, method: LinearMethod, shard: ShardContext,
                   sparse: bool, sliding_window: int | None) -> nn.Module:
        # NOTE: MLA layers attend through attention/mla.py (the worker's MLABackend lays out their cache)
        return DeepseekDecoderLayer(cfg, method, shard, sparse)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """DeepSeek-V3's multi-token-prediction layers, stored after the decoder's (model.layers.{n}. and on
        with n = num_hidden_layers): transformers drops them too; nothing here drafts with them yet."""
        found = _LAYER_INDEX.match(name)
        return found is not None and int(found.group(1)) >= self.config.num_hidden_layers
