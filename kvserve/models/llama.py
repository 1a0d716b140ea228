"""Llama-family decoder over a flattened, paged batch: Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, and the
Mixture-of-Experts ones (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE); what each changes is a flag of
model_loader/architectures.py's ArchFeatures.

Follows transformers' modeling_llama / modeling_qwen2 / modeling_qwen3 (RMSNorm, rotate-half RoPE, GQA,
SwiGLU), modeling_qwen3_moe / modeling_qwen2_moe (sparse MLP blocks), modeling_olmoe (full-width q/k norm,
clip_qkv) and modeling_granite (the four multipliers), with two serving changes: q/k/v and gate/up projections
are fused into one matmul each, and the input is a flat token batch [T] with positions, whose attention goes
through the paged KV cache.

This file describes the network only: the layers (kvserve/layers) load their own weights, shards
included, and multiply through a pluggable method; model_loader/weight_loader.py maps checkpoint names to them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.backend import AttentionBackend
from kvserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                   RowParallelLinear)
from kvserve.layers.linear_methods import DenseMethod, LinearMethod
from kvserve.layers.moe import FusedMoE
from kvserve.layers.parallel import ShardContext
from kvserve.model_loader.architectures import (ArchFeatures, layer_sliding_windows, longrope_switch_length,
                                                moe_intermediate_size, moe_layer_indices, num_experts)
from kvserve.models.layer_ops import LayerOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _default_inv_freq(hf_config) -> torch.Tensor:
    """Unscaled RoPE's inverse frequencies over the whole head, as LlamaRotaryEmbedding's default computes them."""
    base = hf_config.rope_parameters["rope_theta"]
    dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, from HF's own rope initialisation
    (so rope_scaling variants such as Llama-3's match the oracle exactly).

    Partial RoPE (`partial_rotary_factor` < 1, Phi-4-mini): the tables are [P, R] for the first R of each head's
    dims, which are all that rotate (LayerOps.rope_qk reads R from them).

    longrope (Phi-3 long-context): transformers rotates a whole sequence with its short factors while the
    sequence has at most M = `original_max_position_embeddings` tokens, with its long ones once it is longer
    (its generate drops the cache and recomputes everything at the crossing). Both tables are kept, stacked:
    rows [0, P) short, [P, 2P) long; the model runner adds `long_switch`'s offset P to the positions of a
    request whose prompt is longer than M (worker/step_inputs.py rope_positions), and the engine keys such a
    request's prefix-cache blocks apart (engine/core.py), so a request whose prompt exceeds M, or whose whole
    sequence stays within M, is computed exactly as transformers does. Known caveat: a request whose prompt is
    within M but whose output crosses it keeps the short factors to its end, where transformers would re-rotate
    the whole sequence with the long ones. A paged cache cannot do that re-rotation (blocks are shared by
    prefix hits, and their keys are rotated when written); switching only the new tokens instead would rotate
    queries and cached keys with different frequencies, which breaks RoPE's relative-position property.
    """

    def __init__(self, hf_config, max_positions: int):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        # NOTE: on the CPU even while the model is built on the meta device (models/build.py), where arange
        # runs through torch._refs, whose first use imports torch._dynamo: seconds of every server start
        with torch.device("cpu"):
            rope_type = hf_config.rope_parameters["rope_type"]
            # NOTE: what transformers' LlamaRotaryEmbedding computes, without importing its modeling module (which
            # imports torch._dynamo too)
            inv_freq, attention_scaling = (_default_inv_freq(hf_config), 1.0) if rope_type == "default" else \
                ROPE_INIT_FUNCTIONS[rope_type](hf_config)
            inv_freqs = [inv_freq.float()]                                         # [R/2] per factor set
            if rope_type == "default" and getattr(hf_config, "model_type", None) == "phi3":
                # transformers' default RoPE honours partial_rotary_factor in Phi-3 only (the Llama family's, like
                # LlamaRotaryEmbedding's, rotates whole heads); its scaled types honour it everywhere
                from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
                inv_freqs = [Phi3RotaryEmbedding.compute_default_rope_parameters(hf_config)[0].float()]
            rotary_dim = 2 * inv_freqs[0].numel()
            if rotary_dim > hf_config.head_dim:
                raise ValueError(f"RoPE over {rotary_dim} dims of a {hf_config.head_dim}-dim head")
            self.long_switch: tuple[int, int] | None = None
            """longrope: (M, row offset of the long table): positions of requests whose prompt exceeds M come offset."""
            original = longrope_switch_length(hf_config, max_positions)
            if original is not None:  # else no sequence ever switches: the short table alone
                long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=original + 1)
                inv_freqs.append(long_inv_freq.float())
                self.long_switch = (original, max_positions)
            positions = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.cat([torch.outer(positions, f) for f in inv_freqs])   # [P * sets, R/2]
            emb = torch.cat((freqs, freqs), dim=-1)                               # [P * sets, R]
            self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
            self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the step's positions, each [T, R]; looked up once per step, not per layer."""
        cos = self.cos.index_select(0, positions).to(dtype)
        sin = self.sin.index_select(0, positions).to(dtype)
        return cos, sin


class Attention(nn.Module):
    def __init__(self, cfg, feats: ArchFeatures, backend: AttentionBackend, method: LinearMethod,
                 shard: ShardContext, sliding_window: int | None = None):
        super().__init__()
        self.sliding_window = sliding_window
        # attention_bias (Llama, Qwen3, OLMoE, Granite configs): q, k, v and o biased; Qwen2: q, k, v only
        bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = (bool(getattr(cfg, "qkv_bias", True)) if feats.qkv_bias_from_config else feats.qkv_bias) or bias
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, qkv_bias, method, shard.rank, shard.size)
        self.num_heads = self.qkv_proj.num_heads        # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.head_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        self.scale = cfg.attention_multiplier if feats.multipliers else self.head_dim ** -0.5
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias, method,
                                        shard.rank, shard.size, shard.all_reduce)
        # Qwen3: per head (width head_dim); OLMoE: over the whole projection (one rank holds all of it)
        q_width, k_width = (self.q_size, self.kv_size) if feats.qk_norm_full_width else (self.head_dim,) * 2
        has_norm = feats.qk_norm or feats.qk_norm_full_width
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps) if has_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps) if has_norm else None
        self.clip_qkv = getattr(cfg, "clip_qkv", None) if feats.qk_norm_full_width else None
        self.logits_soft_cap: float | None = None  # Gemma 2's (models/gemma.py)
        self.backend = backend

    def forward(self, x, rope_cos_sin, kv_cache, attn_meta, ops: LayerOps) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)                                        # [T, q + 2 kv]
        if self.q_norm is not None:  # RMSNorm on q and k before RoPE, per head of width q_norm's
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(t, -1, self.q_norm.weight.shape[0])).view(t, -1)
            k = self.k_norm(k.reshape(t, -1, self.k_norm.weight.shape[0])).view(t, -1)
            qkv = torch.cat((q, k, v), dim=-1)
            if self.clip_qkv is not None:
                qkv = qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        # RoPE on the q and k heads together, in one call (they are adjacent in the fused projection)
        qkv = ops.rope_qk(qkv, *rope_cos_sin, self.num_heads + self.num_kv_heads, self.head_dim)
        # q [T, Hq, D], k and v [T, Hkv, D]: views split by heads (two calls where split + three views took four)
        q, k, v = qkv.view(t, -1, self.head_dim).split_with_sizes(self.head_split, dim=1)
        o = self.backend.forward(q, k, v, kv_cache, attn_meta, self.scale,   # [T, Hq, D]
                                 sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap)
        return self.o_proj.forward(o.reshape(t, self.q_size))


ActAndMul = Callable[[torch.Tensor], torch.Tensor]


def gated_activation(cfg) -> ActAndMul | None:
    """act(gate) * up over a fused [T, 2I] gate_up, for a config whose `hidden_act` is not SiLU (transformers'
    ACT2FN[hidden_act]); None for SiLU, which the layer ops compute (fused where they build)."""
    name = getattr(cfg, "hidden_act", "silu")
    if name in ("silu", "swish"):
        return None
    from transformers.activations import ACT2FN

    act = ACT2FN[name]

    def act_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up
    return act_and_mul


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, method: LinearMethod, shard: ShardContext,
                 act_and_mul: ActAndMul | None = None, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, method,
                                                       shard.rank, shard.size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, method, shard.rank,
                                           shard.size, shard.all_reduce)
        self.act_and_mul = act_and_mul  # None: SiLU, the layer ops'

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        act_and_mul = ops.silu_and_mul if self.act_and_mul is None else self.act_and_mul
        return self.down_proj.forward(act_and_mul(self.gate_up_proj.forward(x)))


class SparseMoeBlock(nn.Module):
    """transformers' Qwen3MoeSparseMoeBlock (Qwen2MoeSparseMoeBlock with a shared expert): the router `gate`
    (replicated, unquantized: its logits pick the experts) and the routed `experts`."""

    def __init__(self, cfg, feats: ArchFeatures, method: LinearMethod, shard: ShardContext):
        super().__init__()
        experts = num_experts(cfg)
        self.gate = ReplicatedLinear(cfg.hidden_size, experts, False, DenseMethod())
        self.experts = FusedMoE(experts, cfg.num_experts_per_tok, cfg.hidden_size, moe_intermediate_size(cfg),
                                bool(getattr(cfg, "norm_topk_prob", True)), shard.rank, shard.size, shard.all_reduce,
                                expert_names=feats.expert_names, stacked_names=feats.stacked_expert_names,
                                method=method)
        # names in the checkpoint where they differ from ours (weight_loader.py)
        self.checkpoint_name, self.gate.checkpoint_name = feats.moe_prefix, feats.router_name
        self.act_and_mul = gated_activation(cfg)  # None: SiLU, the layer ops'
        if self.act_and_mul is not None and self.experts.impl == "fused":
            self.experts.impl = "sorted"  # the C++ expert loop fuses SiLU only
        self.shared_expert = None
        if feats.shared_expert:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, method, shard,
                                     self.act_and_mul)
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, False, DenseMethod())

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        act_and_mul = ops.silu_and_mul if self.act_and_mul is None else self.act_and_mul
        out = self.experts.forward(x, self.gate.forward(x), act_and_mul)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate.forward(x)) * self.shared_expert.forward(x, ops)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg, feats: ArchFeatures, backend: AttentionBackend, method: LinearMethod,
                 shard: ShardContext, sparse: bool = False, sliding_window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, feats, backend, method, shard, sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (SparseMoeBlock(cfg, feats, method, shard) if sparse
                    else MLP(cfg.hidden_size, cfg.intermediate_size, method, shard, gated_activation(cfg),
                             bool(getattr(cfg, "mlp_bias", False))))  # mlp_bias: Llama, Granite configs
        # Granite: each sublayer's output is scaled before it joins the residual stream
        self.residual_multiplier = cfg.residual_multiplier if feats.multipliers else None

    def forward(self, x, residual, rope_cos_sin, kv_cache, attn_meta, ops: LayerOps):
        """x: the previous sublayer's output (or the embeddings), residual: the stream before it (None in
        the first layer). Returns the same pair for the next layer: the residual add is fused into each
        RMSNorm (vLLM's layout), so the stream is only summed where it is normalised."""
        norm = self.input_layernorm
        x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        x = self.self_attn.forward(x, rope_cos_sin, kv_cache, attn_meta, ops)
        if self.residual_multiplier is not None:
            x = x * self.residual_multiplier
        norm = self.post_attention_layernorm
        x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        x = self.mlp.forward(x, ops)
        if self.residual_multiplier is not None:
            x = x * self.residual_multiplier
        return x, residual


class LlamaForCausalLM(nn.Module):
    """`forward` returns final hidden states [T, hidden]; `compute_logits` applies the LM head only to
    the rows that are sampled, which on CPU saves most of the 49k-wide head's cost during prefill."""

    def __init__(self, cfg, feats: ArchFeatures, backend: AttentionBackend, max_positions: int,
                 method: LinearMethod, shard: ShardContext = ShardContext(), head_method: LinearMethod | None = None):
        super().__init__()
        self.config = cfg
        self.feats = feats
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard.rank, shard.size,
                                                   shard.all_reduce)
        sparse = moe_layer_indices(cfg, feats)
        windows = layer_sliding_windows(cfg)
        self.layers = nn.ModuleList(self.make_layer(cfg, feats, backend, method, shard, i in sparse, windows[i])
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg, max_positions)
        tied = self.embed_tokens if getattr(cfg, "tie_word_embeddings", False) else None
        # head_method: the LM head's own (int8 per 32 inputs under a quantization unless --no-quantize-lm-head:
        # layers/quant/__init__.py)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, head_method or method, tied, shard.rank,
                                      shard.size, shard.all_gather)
        self.ops: LayerOps = LayerOps()  # the worker swaps in FusedLayerOps where they build
        # Granite: embeddings multiplied, logits divided (None elsewhere: no extra op)
        self.embedding_multiplier = cfg.embedding_multiplier if feats.multipliers else None
        self.logits_scaling = cfg.logits_scaling if feats.multipliers else None

    @staticmethod
    def make_layer(cfg, feats: ArchFeatures, backend: AttentionBackend, method: LinearMethod, shard: ShardContext,
                   sparse: bool, sliding_window: int | None) -> nn.Module:
        """One decoder layer: forward(x, residual, rope_cos_sin, kv_cache, attn_meta, ops) -> (x, residual).
        A network that differs only in its layers subclasses this model (models/deepseek.py)."""
        return DecoderLayer(cfg, feats, backend, method, shard, sparse, sliding_window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                                      # [T, hidden]
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        rope_cos_sin = self.rope(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            # NOTE: forward, not __call__: nn.Module's call machinery (hooks, which nothing here registers)
            # cost ~0.5 us a call, 7 calls a layer, in decode steps whose Python is a fifth of their time
            x, residual = layer.forward(x, residual, rope_cos_sin, kv_cache, attn_meta, self.ops)
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)                                         # [N, vocab] float32
        return logits if self.logits_scaling is None else logits / self.logits_scaling
