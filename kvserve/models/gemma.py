"""Gemma 2 and Gemma 3 (text) decoders over a flattened, paged batch.

Follows transformers' modeling_gemma2 / modeling_gemma3. What differs from the Llama network (models/llama.py,
whose fused q/k/v projection, attention and MLP layout this reuses):
- RMSNorm computed in float32 and scaled by (1 + w) (the checkpoint stores w; zero is the identity);
- embeddings scaled by sqrt(hidden_size), rounded to the model dtype first as transformers does;
- four norms a layer: each sublayer's output is normalised again before it joins the residual stream;
- GELU (tanh approximation) gating in the MLP;
- attention scale query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- layers of two types (config.layer_types): sliding-window ones and global ones, each with its own RoPE table
  in Gemma 3 (rope_parameters per layer type: the local base frequency for sliding layers, rope_theta and any
  scaling for global ones);
- Gemma 2: attention scores soft-capped (attn_logit_softcapping) and final logits soft-capped
  (final_logit_softcapping, Gemma 3 too where its config sets one); Gemma 3: per-head q/k norms.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.backend import AttentionBackend
from kvserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.layers.linear_methods import LinearMethod
from kvserve.layers.parallel import ShardContext
from kvserve.model_loader.architectures import ArchFeatures, layer_sliding_windows
from kvserve.models.layer_ops import LayerOps
from kvserve.models.llama import MLP, Attention

_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
# RoPE variants whose frequencies depend on the sequence being run (transformers recomputes them per call):
# one table per layer type cannot hold them.
_DYNAMIC_ROPE = ("dynamic", "longrope")


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w) in float32, cast back to x's dtype (transformers' Gemma RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.scale: torch.Tensor | None = None
        """1 + w in float32, set once the weight is loaded (a bfloat16 1 + w would round it)."""

    def process_weights_after_loading(self) -> None:
        self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale if self.scale is not None else 1.0 + self.weight.detach().float()
        return F.rms_norm(x.float(), (x.shape[-1],), scale, self.eps).to(x.dtype)


def _add_norm(x: torch.Tensor, residual: torch.Tensor | None,
              norm: GemmaRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); with no residual yet, x itself is the residual."""
    residual = x if residual is None else x + residual
    return norm(residual), residual


def _hf_inv_freqs(hf_config) -> dict[str, tuple[torch.Tensor, float]]:
    """Layer type -> (inverse frequencies [D/2], attention scaling), from transformers' own rotary modules so
    that every rope_type it knows (linear for Gemma 3's global layers) matches the oracle exactly."""
    params = hf_config.rope_parameters or {}
    types = sorted(set(hf_config.layer_types))
    if all(isinstance(params.get(t), dict) for t in types):  # Gemma 3: a parameter set per layer type
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

        rope = Gemma3RotaryEmbedding(hf_config)
        kinds = {t: rope.rope_type[t] for t in types}
        freqs = {t: (getattr(rope, f"{t}_inv_freq"), getattr(rope, f"{t}_attention_scaling")) for t in types}
    else:                                                    # Gemma 2: one set for every layer
        from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding

        rope = Gemma2RotaryEmbedding(hf_config)
        kinds = {t: rope.rope_type for t in types}
        freqs = {t: (rope.inv_freq, rope.attention_scaling) for t in types}
    dynamic = sorted({k for k in kinds.values() if k in _DYNAMIC_ROPE})
    if dynamic:
        raise ValueError(f"{dynamic[0]} RoPE scaling is not supported for Gemma yet")
    return freqs


class GemmaRotaryEmbedding(nn.Module):
    """cos/sin tables [K, P, D]: one for each distinct RoPE of the layer types (Gemma 3: two; Gemma 2: one), every
    position up to max_positions. `table_of[layer_type]` is the table a layer of that type rotates with."""

    def __init__(self, hf_config, max_positions: int):
        super().__init__()
        with torch.device("cpu"):  # compared below: real values even when the model is built on the meta device
            freqs = _hf_inv_freqs(hf_config)
        distinct: list[tuple[torch.Tensor, float]] = []
        self.table_of: dict[str, int] = {}
        for layer_type, (inv_freq, scaling) in freqs.items():
            same = [i for i, (f, s) in enumerate(distinct) if s == scaling and torch.equal(f, inv_freq)]
            if not same:
                distinct.append((inv_freq, scaling))
            self.table_of[layer_type] = same[0] if same else len(distinct) - 1
        positions = torch.arange(max_positions, dtype=torch.float32)
        cos, sin = [], []
        for inv_freq, scaling in distinct:
            angles = torch.outer(positions, inv_freq.float().to(positions.device))  # [P, D/2]
            emb = torch.cat((angles, angles), dim=-1)                         # [P, D]
            if emb.shape[-1] != hf_config.head_dim:
                raise ValueError("RoPE over part of each head is not supported for Gemma")
            cos.append(emb.cos() * scaling)
            sin.append(emb.sin() * scaling)
        self.register_buffer("cos", torch.stack(cos), persistent=False)
        self.register_buffer("sin", torch.stack(sin), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per table, cos and sin [T, D] of the step's positions."""
        cos = self.cos.index_select(1, positions).to(dtype)
        sin = self.sin.index_select(1, positions).to(dtype)
        return list(zip(cos.unbind(0), sin.unbind(0)))


class GemmaAttention(Attention):
    """Llama's attention with Gemma's scale, soft cap (Gemma 2) and (1 + w) per-head q/k norms (Gemma 3)."""

    def __init__(self, cfg, feats: ArchFeatures, backend: AttentionBackend, method: LinearMethod,
                 shard: ShardContext, sliding_window: int | None):
        super().__init__(cfg, feats, backend, method, shard, sliding_window)
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        # NOTE: transformers' Gemma 3 attention ignores attn_logit_softcapping (its configs leave it unset)
        self.logits_soft_cap = cfg.attn_logit_softcapping if feats.attn_soft_cap else None
        if feats.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.down_proj.forward(ops.gelu_tanh_and_mul(self.gate_up_proj.forward(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, feats: ArchFeatures, backend: AttentionBackend, method: LinearMethod,
                 shard: ShardContext, sliding_window: int | None, rope_index: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = GemmaAttention(cfg, feats, backend, method, shard, sliding_window)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GemmaMLP(cfg.hidden_size, cfg.intermediate_size, method, shard)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.rope_index = rope_index
        """Which of GemmaRotaryEmbedding's tables this layer rotates with (its layer type's)."""

    def forward(self, x, residual, rope_tables, kv_cache, attn_meta, ops: LayerOps):
        """x: the previous layer's (post-normalised) MLP output, or the embeddings; residual: the stream before
        it (None in the first layer). Returns the same pair for the next layer."""
        x, residual = _add_norm(x, residual, self.input_layernorm)
        x = self.self_attn.forward(x, rope_tables[self.rope_index], kv_cache, attn_meta, ops)
        x, residual = _add_norm(self.post_attention_layernorm(x), residual, self.pre_feedforward_layernorm)
        x = self.mlp.forward(x, ops)
        return self.post_feedforward_layernorm(x), residual


class GemmaForCausalLM(nn.Module):
    """Same interface as LlamaForCausalLM: `forward` returns final hidden states [T, hidden], `compute_logits`
    the (soft-capped) logits of the rows that are sampled."""

    def __init__(self, cfg, feats: ArchFeatures, backend: AttentionBackend, max_positions: int,
                 method: LinearMethod, shard: ShardContext = ShardContext(), head_method: LinearMethod | None = None):
        super().__init__()
        _check_supported(cfg)
        self.config = cfg
        self.feats = feats
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard.rank, shard.size,
                                                   shard.all_reduce)
        self.rope = GemmaRotaryEmbedding(cfg, max_positions)
        windows = layer_sliding_windows(cfg)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, feats, backend, method, shard, windows[i],
                                                      self.rope.table_of[cfg.layer_types[i]])
                                    for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        tied = self.embed_tokens if getattr(cfg, "tie_word_embeddings", True) else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, head_method or method, tied, shard.rank,
                                      shard.size, shard.all_gather)
        self.ops: LayerOps = LayerOps()  # the worker swaps in FusedLayerOps where they build
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                                      # [T, hidden]
        x = x * _in_dtype(self.embed_scale, x.dtype)
        rope_tables = self.rope(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer.forward(x, residual, rope_tables, kv_cache, attn_meta, self.ops)
        return self.norm(x + residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)                                         # [N, vocab] float32
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


@functools.cache
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype`, as transformers multiplies the embeddings by a scale held in their dtype."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))


def _check_supported(cfg) -> None:
    """Refuse the Gemma variants this network would compute differently from transformers, by name."""
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act not in _ACTIVATIONS:
        raise ValueError(f"Gemma MLP activation {act!r} is not supported (only {', '.join(_ACTIVATIONS)})")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not supported")
    if getattr(cfg, "attention_bias", False):
        raise ValueError("Gemma with attention_bias is not supported")
