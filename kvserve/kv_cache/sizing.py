"""KV-cache sizing from a model config alone (used by the engine and by `kvserve kv-calc`)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def config_get(config: Any, key: str) -> Any:
    """Read `key` from a transformers config object or a config.json dict (None if absent)."""
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def _require_positive_int(config: Any, key: str) -> int:
    value = config_get(config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"model config field {key!r} must be a positive integer, got {value!r}")
    return value


def attention_shape(config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config."""
    num_layers = _require_positive_int(config, "num_hidden_layers")
    num_heads = _require_positive_int(config, "num_attention_heads")
    # No num_key_value_heads means plain multi-head attention (one KV head per query head).
    num_kv_heads = num_heads if config_get(config, "num_key_value_heads") is None else _require_positive_int(config, "num_key_value_heads")
    if config_get(config, "head_dim") is not None:
        head_dim = _require_positive_int(config, "head_dim")
    else:
        head_dim = _require_positive_int(config, "hidden_size") // num_heads
    return num_layers, num_kv_heads, head_dim


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """KV-cache bytes one token occupies across all layers: 2 × layers × kv_heads × head_dim × dtype_bytes.

    `config` is a transformers config or a config.json dict. `num_key_value_heads` falls back to
    `num_attention_heads` (MHA) when absent; `head_dim` to `hidden_size // num_attention_heads`.

    Raises:
        ValueError: a required field is missing or not a positive integer, or `dtype_bytes` is
            not a positive integer.
    """
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be a positive integer, got {dtype_bytes!r}")
    return kv_bytes(*attention_shape(config), dtype_bytes)


def kv_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float) -> int:
    """The formula: K and V, per layer, per KV head, per element of head_dim (scales not included)."""
    return int(2 * num_layers * num_kv_heads * head_dim * dtype_bytes)
