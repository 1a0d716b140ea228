"""KV-cache sizing from a model config alone (used by the engine and by `kvserve kv-calc`)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def config_get(config: Any, key: str) -> Any:
    """Read `key` from a transformers config object or a config.json dict (None if absent)."""
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


# The names one quantity goes by in config.json files: Llama's (and most HF models') first, then GPT-2's
# and Falcon's. The first key present is read.
NUM_LAYERS_KEYS = ("num_hidden_layers", "n_layer")
NUM_HEADS_KEYS = ("num_attention_heads", "n_head")
HIDDEN_SIZE_KEYS = ("hidden_size", "n_embd")
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")
_FALCON_KV_HEADS_KEYS = ("num_kv_heads", "n_head_kv")


def first_key(config: Any, keys: tuple[str, ...]) -> str | None:
    """The first of `keys` the config sets (not None), or None."""
    return next((k for k in keys if config_get(config, k) is not None), None)


def _require_positive_int(config: Any, keys: str | tuple[str, ...]) -> int:
    keys = (keys,) if isinstance(keys, str) else keys
    key = first_key(config, keys) or keys[0]
    value = config_get(config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"model config field {key!r} must be a positive integer, got {value!r}")
    return value


def num_query_heads(config: Any) -> int:
    """Attention (query) heads per layer: num_attention_heads, or GPT-2/Falcon's n_head."""
    return _require_positive_int(config, NUM_HEADS_KEYS)


def _num_kv_heads(config: Any) -> int:
    if config_get(config, "num_key_value_heads") is not None:
        return _require_positive_int(config, "num_key_value_heads")
    falcon_key = first_key(config, _FALCON_KV_HEADS_KEYS)
    # NOTE: transformers' Falcon rule: new_decoder_architecture reads num_kv_heads; otherwise multi_query
    # means one KV head even when a saved config also carries num_kv_heads (it defaults to n_head there).
    # GPT-BigCode (StarCoder) says multi_query too.
    if config_get(config, "new_decoder_architecture") and falcon_key is not None:
        return _require_positive_int(config, falcon_key)
    if config_get(config, "multi_query"):
        return 1
    if falcon_key is not None:
        return _require_positive_int(config, falcon_key)
    return num_query_heads(config)  # plain multi-head attention: one KV head per query head


def attention_shape(config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config, Llama-, GPT-2- or Falcon-style."""
    num_layers = _require_positive_int(config, NUM_LAYERS_KEYS)
    num_kv_heads = _num_kv_heads(config)
    if config_get(config, "head_dim") is not None:
        head_dim = _require_positive_int(config, "head_dim")
    else:
        head_dim = _require_positive_int(config, HIDDEN_SIZE_KEYS) // num_query_heads(config)
    return num_layers, num_kv_heads, head_dim


def mla_latent(config: Any) -> tuple[int, int] | None:
    """(kv_lora_rank, qk_rope_head_dim) of a Multi-head Latent Attention model (DeepSeek-V2/V3, Kimi), whose
    cache holds one latent vector and one shared RoPE key per token and layer instead of K and V per head; None
    for any other model."""
    if config_get(config, "kv_lora_rank") is None:
        return None
    return (_require_positive_int(config, "kv_lora_rank"), _require_positive_int(config, "qk_rope_head_dim"))


def mla_bytes(num_layers: int, kv_lora_rank: int, rope_dim: int, dtype_bytes: float) -> int:
    """An MLA cache's bytes per token: per layer ONE vector of kv_lora_rank + rope_dim elements (no K/V pair,
    no per-head copies: every head reads the same latent)."""
    return int(num_layers * (kv_lora_rank + rope_dim) * dtype_bytes)


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """KV-cache bytes one token occupies across all layers: 2 × layers × kv_heads × head_dim × dtype_bytes, or
    for an MLA model (mla_latent) layers × (kv_lora_rank + qk_rope_head_dim) × dtype_bytes.

    `config` is a transformers config or a config.json dict. `num_key_value_heads` falls back to Falcon's
    `num_kv_heads`/`n_head_kv`, to 1 for `multi_query`, else to `num_attention_heads` (MHA); `head_dim` to
    `hidden_size // num_attention_heads` (GPT-2's `n_embd // n_head`).

    Raises:
        ValueError: a required field is missing or not a positive integer, or `dtype_bytes` is
            not a positive integer.
    """
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be a positive integer, got {dtype_bytes!r}")
    latent = mla_latent(config)
    if latent is not None:
        return mla_bytes(_require_positive_int(config, NUM_LAYERS_KEYS), *latent, dtype_bytes)
    return kv_bytes(*attention_shape(config), dtype_bytes)


def kv_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float, scale_bytes: int = 0) -> int:
    """The formula: K and V, per layer, per KV head, head_dim elements plus, for a quantized cache
    (kv_cache/quant.py), the bytes of that head's one scale. A block's bytes are the same formula with
    head_dim x block_size elements (a quantized cache's one scale per block)."""
    return int(2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes))
