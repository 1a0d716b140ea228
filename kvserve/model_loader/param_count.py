"""Parameter counts from a config alone (no weights, no torch): the total a model holds and the part one token
runs through (a Mixture-of-Experts model runs k of its E routed experts), which is what `kvserve kv-calc`
weighs against the KV cache.

The formula is the Llama family's as transformers builds it (embeddings, attention, SwiGLU MLP, RMSNorms), with
the variants of the architectures kvserve serves: q/k norms (Qwen3, Gemma 3: per head; OLMoE: full width),
QKV biases (Qwen2), Gemma 2/3's four norms a layer, DeepSeek's MLA projections, routed and shared experts with
the dense layers each config names. Configs of other families (GPT-2, Falcon: no `intermediate_size`) get None.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.kv_cache.sizing import attention_shape, config_get, first_key, mla_latent, num_query_heads

NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
_HEAD_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", "gemma3")
_FOUR_NORM_TYPES = ("gemma2", "gemma3_text", "gemma3")


@dataclass(frozen=True)
class ParamCount:
    total: int
    """Every parameter the model holds."""
    active: int
    """The parameters one token runs through: `total` less the routed experts it does not pick."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    experts_per_token: int = 0
    num_moe_layers: int = 0


def num_experts(config: Any) -> int:
    """Routed experts per MoE layer, whatever the config calls them (0 for a dense model)."""
    key = first_key(config, NUM_EXPERTS_KEYS)
    return int(config_get(config, key) or 0) if key else 0


def moe_layers(config: Any) -> list[int]:
    """The sparse decoder layers, as transformers decides: DeepSeek's dense first `first_k_dense_replace` layers
    (then every `moe_layer_freq`-th), else Qwen's `mlp_only_layers` / `decoder_sparse_step`, else all."""
    n = int(config_get(config, "num_hidden_layers"))
    if num_experts(config) == 0:
        return []
    first_dense = config_get(config, "first_k_dense_replace")
    if first_dense is not None:
        freq = int(config_get(config, "moe_layer_freq") or 1)
        return [i for i in range(n) if i >= first_dense and i % freq == 0]
    dense = set(config_get(config, "mlp_only_layers") or [])
    step = int(config_get(config, "decoder_sparse_step") or 1)
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def _attention_params(config: Any, hidden: int) -> int:
    """One layer's attention projections (and q/k norms, biases)."""
    heads = num_query_heads(config)
    latent = mla_latent(config)
    if latent is not None:  # DeepSeek: q (through a low-rank q_a/q_b when q_lora_rank), kv_a, kv_b, o
        kv_rank, rope = latent
        nope, v_dim = int(config_get(config, "qk_nope_head_dim")), int(config_get(config, "v_head_dim"))
        q_rank = config_get(config, "q_lora_rank")
        q = (hidden + 1 + heads * (nope + rope)) * q_rank if q_rank else hidden * heads * (nope + rope)
        return q + hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim) + heads * v_dim * hidden
    _, kv_heads, head_dim = attention_shape(config)
    qkv = (heads + 2 * kv_heads) * head_dim
    params = hidden * qkv + heads * head_dim * hidden
    model_type = config_get(config, "model_type")
    if model_type in _QKV_BIAS_TYPES or config_get(config, "attention_bias"):
        params += qkv + (hidden if config_get(config, "attention_bias") else 0)
    if model_type in _HEAD_QK_NORM_TYPES:
        params += 2 * head_dim
    elif model_type == "olmoe":
        params += (heads + kv_heads) * head_dim
    return params


def _moe_params(config: Any, hidden: int, experts: int) -> tuple[int, int]:
    """(one MoE layer's parameters, those of its routed experts)."""
    expert = 3 * hidden * int(config_get(config, "moe_intermediate_size") or config_get(config, "intermediate_size"))
    shared = 0
    if config_get(config, "n_shared_experts"):               # DeepSeek: n_shared_experts experts' width
        shared = int(config_get(config, "n_shared_experts")) * expert
    elif config_get(config, "shared_expert_intermediate_size"):  # Qwen2-MoE: its own width, sigmoid-gated
        shared = 3 * hidden * int(config_get(config, "shared_expert_intermediate_size")) + hidden
    return hidden * experts + experts * expert + shared, experts * expert


def param_count(config: Any) -> ParamCount | None:
    """Total and per-token parameters of a Llama-family config (a dict or a transformers config); None for
    a family this formula does not describe."""
    keys = ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers")
    if any(config_get(config, key) is None for key in keys):
        return None
    hidden, vocab, n = (int(config_get(config, k)) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    norms = (4 if config_get(config, "model_type") in _FOUR_NORM_TYPES else 2) * hidden
    dense_layer = _attention_params(config, hidden) + norms + 3 * hidden * int(config_get(config, "intermediate_size"))
    sparse = moe_layers(config)
    experts = num_experts(config)
    top_k = int(config_get(config, "num_experts_per_tok") or 0) if sparse else 0
    total = n * dense_layer + vocab * hidden * (1 if config_get(config, "tie_word_embeddings") else 2) + hidden
    routed = 0
    if sparse:
        moe_layer, routed = _moe_params(config, hidden, experts)
        total += len(sparse) * (moe_layer - 3 * hidden * int(config_get(config, "intermediate_size")))
    unused = len(sparse) * routed * (experts - top_k) // experts if experts else 0
    return ParamCount(total, total - unused, experts if sparse else 0, top_k, len(sparse))
