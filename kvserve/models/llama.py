"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened, paged batch.

Follows transformers' modeling_llama / modeling_qwen2 / modeling_qwen3 (RMSNorm, rotate-half RoPE, GQA,
SwiGLU), with two serving changes: q/k/v and gate/up projections are fused into one matmul each, and the
input is a flat token batch [T] with positions, whose attention goes through the paged KV cache.

This file describes the network only: the layers (kvserve/layers) load their own weights, shards
included, and multiply through a pluggable method; model_loader/weight_loader.py maps checkpoint names to them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.backend import AttentionBackend
from kvserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvserve.layers.linear_methods import LinearMethod
from kvserve.layers.parallel import ShardContext
from kvserve.model_loader.architectures import ArchFeatures
from kvserve.models.layer_ops import LayerOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, from HF's own rope initialisation
    (so rope_scaling variants such as Llama-3's match the oracle exactly)."""

    def __init__(self, hf_config, max_positions: int):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        hf_rope = LlamaRotaryEmbedding(config=hf_config)
        inv_freq = hf_rope.inv_freq.float()                                   # [D/2]
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)                               # [P, D]
        self.register_buffer("cos", emb.cos() * hf_rope.attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * hf_rope.attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the step's positions, each [T, D]; looked up once per step, not per layer."""
        cos = self.cos.index_select(0, positions).to(dtype)
        sin = self.sin.index_select(0, positions).to(dtype)
        return cos, sin


class Attention(nn.Module):
    def __init__(self, cfg, feats: ArchFeatures, backend: AttentionBackend, method: LinearMethod,
                 shard: ShardContext):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, feats.qkv_bias, method, shard.rank, shard.size)
        self.num_heads = self.qkv_proj.num_heads        # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.head_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        self.scale = self.head_dim ** -0.5
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, False, method,
                                        shard.rank, shard.size, shard.all_reduce)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if feats.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if feats.qk_norm else None
        self.backend = backend

    def forward(self, x, rope_cos_sin, kv_cache, attn_meta, ops: LayerOps) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)                                        # [T, q + 2 kv]
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm on q and k before RoPE
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, -1)
            qkv = torch.cat((q, k, v), dim=-1)
        # RoPE on the q and k heads together, in one call (they are adjacent in the fused projection)
        qkv = ops.rope_qk(qkv, *rope_cos_sin, self.num_heads + self.num_kv_heads, self.head_dim)
        # q [T, Hq, D], k and v [T, Hkv, D]: views split by heads (two calls where split + three views took four)
        q, k, v = qkv.view(t, -1, self.head_dim).split_with_sizes(self.head_split, dim=1)
        o = self.backend.forward(q, k, v, kv_cache, attn_meta, self.scale)    # [T, Hq, D]
        return self.o_proj.forward(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg, method: LinearMethod, shard: ShardContext):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, method,
                                                       shard.rank, shard.size)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, method, shard.rank,
                                           shard.size, shard.all_reduce)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.down_proj.forward(ops.silu_and_mul(self.gate_up_proj.forward(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, feats: ArchFeatures, backend: AttentionBackend, method: LinearMethod,
                 shard: ShardContext):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, feats, backend, method, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, method, shard)

    def forward(self, x, residual, rope_cos_sin, kv_cache, attn_meta, ops: LayerOps):
        """x: the previous sublayer's output (or the embeddings), residual: the stream before it (None in
        the first layer). Returns the same pair for the next layer: the residual add is fused into each
        RMSNorm (vLLM's layout), so the stream is only summed where it is normalised."""
        norm = self.input_layernorm
        x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        x = self.self_attn.forward(x, rope_cos_sin, kv_cache, attn_meta, ops)
        norm = self.post_attention_layernorm
        x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.mlp.forward(x, ops), residual


class LlamaForCausalLM(nn.Module):
    """`forward` returns final hidden states [T, hidden]; `compute_logits` applies the LM head only to
    the rows that are sampled, which on CPU saves most of the 49k-wide head's cost during prefill."""

    def __init__(self, cfg, feats: ArchFeatures, backend: AttentionBackend, max_positions: int,
                 method: LinearMethod, shard: ShardContext = ShardContext(), head_method: LinearMethod | None = None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard.rank, shard.size,
                                                   shard.all_reduce)
        self.layers = nn.ModuleList(DecoderLayer(cfg, feats, backend, method, shard)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg, max_positions)
        tied = self.embed_tokens if getattr(cfg, "tie_word_embeddings", False) else None
        # head_method: the LM head's own (int8 per 32 inputs under a quantization unless --no-quantize-lm-head:
        # layers/quant/__init__.py)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, head_method or method, tied, shard.rank,
                                      shard.size, shard.all_gather)
        self.ops: LayerOps = LayerOps()  # the worker swaps in FusedLayerOps where they build

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                                      # [T, hidden]
        rope_cos_sin = self.rope(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            # NOTE: forward, not __call__: nn.Module's call machinery (hooks, which nothing here registers)
            # cost ~0.5 us a call, 7 calls a layer, in decode steps whose Python is a fifth of their time
            x, residual = layer.forward(x, residual, rope_cos_sin, kv_cache, attn_meta, self.ops)
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)                                           # [N, vocab] float32
