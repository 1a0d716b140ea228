"""What `kvserve kv-calc` adds for the newer attention layouts: how many tokens each layer keeps under sliding
windows, and the comparison serving guides print for one model: its KV cache as multi-head attention (a KV head
per query head), as grouped-query attention, and as Multi-head Latent Attention (one latent vector a token and
layer), the layouts the model does not have labelled hypothetical.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from kvserve.kv_cache.sizing import attention_shape, config_get, mla_bytes, mla_latent, num_query_heads
from kvserve.model_loader.architectures import layer_sliding_windows

# DeepSeek-V3's latent (kv_lora_rank 512 + qk_rope_head_dim 64): the MLA row of a model that has none.
HYPOTHETICAL_MLA = (512, 64)
# The KV-head count of the GQA row of a model that has no grouping (MHA or MLA): Llama 3's, Qwen's, Mistral's.
HYPOTHETICAL_KV_HEADS = 8
# Gemma's every-n-th layer is global where a config gives the pattern but not `layer_types`.
_WINDOW_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


def layer_windows(config: Any, num_layers: int) -> list[int | None]:
    """Each layer's sliding window (None: global), as model_loader.architectures.layer_sliding_windows decides
    for a loaded config; a config.json that predates `layer_types` gets them from its sliding_window_pattern
    (Gemma 3) or its model type (Gemma 2 alternates), as transformers derives them."""
    types = config_get(config, "layer_types")
    pattern = config_get(config, "sliding_window_pattern") or config_get(config, "_sliding_window_pattern") or \
        _WINDOW_PATTERNS.get(config_get(config, "model_type"))
    if not types and pattern:
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    view = SimpleNamespace(num_hidden_layers=num_layers, sliding_window=config_get(config, "sliding_window"),
                           use_sliding_window=config_get(config, "use_sliding_window"), layer_types=types)
    return layer_sliding_windows(view)


def kept_tokens(windows: list[int | None], context: int) -> int:
    """Token-layers a sequence of `context` tokens keeps: min(context, W) in a windowed layer, all elsewhere."""
    return sum(context if w is None else min(context, w) for w in windows)


def per_sequence(per_token: float, windows: list[int | None], context: int) -> int:
    """KV bytes of one `context`-token sequence: each layer's share of `per_token` for the tokens it keeps."""
    if all(w is None for w in windows):
        return math.ceil(per_token * context)
    kept = kept_tokens(windows, context)
    if isinstance(per_token, int):  # exact: no float rounding of a large product
        return -(-per_token * kept // len(windows))
    return math.ceil(per_token * kept / len(windows))


def _heads_per_rank(heads: int, tp: int) -> int:
    return max(1, heads // tp)


def comparison(config: Any, num_layers: int, dtype_bytes: int, tp: int) -> list[dict[str, Any]]:
    """The MHA, GQA and MLA rows for this model: KV heads, elements a token keeps per layer and bytes per token
    (one rank's under tensor parallelism: K/V heads split, an MLA latent replicated), `configured` on the
    model's own layout, `hypothetical` on the others."""
    heads = num_query_heads(config)
    latent = mla_latent(config)
    if latent is not None:  # MLA models: a head's K is nope + rope wide, its V v_head_dim
        k_dim = int(config_get(config, "qk_nope_head_dim")) + latent[1]
        v_dim = int(config_get(config, "v_head_dim"))
        kv_heads = heads
    else:
        _, kv_heads, k_dim = attention_shape(config)
        v_dim = k_dim
    rows = [_row("MHA", heads, tp, k_dim, v_dim, num_layers, dtype_bytes, latent is None and kv_heads == heads)]
    if latent is None and kv_heads < heads:
        rows.append(_row("GQA" if kv_heads > 1 else "MQA", kv_heads, tp, k_dim, v_dim, num_layers, dtype_bytes,
                         True))
    elif heads > HYPOTHETICAL_KV_HEADS and heads % HYPOTHETICAL_KV_HEADS == 0:
        rows.append(_row("GQA", HYPOTHETICAL_KV_HEADS, tp, k_dim, v_dim, num_layers, dtype_bytes, False))
    rank, rope = latent or HYPOTHETICAL_MLA
    rows.append({"attention": "MLA", "num_kv_heads": None, "kv_lora_rank": rank, "qk_rope_head_dim": rope,
                 "elements_per_layer": rank + rope, "bytes_per_token": mla_bytes(num_layers, rank, rope, dtype_bytes),
                 "configured": latent is not None, "hypothetical": latent is None})
    configured = next(r["bytes_per_token"] for r in rows if r["configured"])
    for row in rows:
        row["vs_configured"] = row["bytes_per_token"] / configured
    return rows


def _row(name: str, kv_heads: int, tp: int, k_dim: int, v_dim: int, num_layers: int, dtype_bytes: int,
         configured: bool) -> dict[str, Any]:
    local = _heads_per_rank(kv_heads, tp)
    return {"attention": name, "num_kv_heads": kv_heads, "kv_lora_rank": None, "qk_rope_head_dim": None,
            "elements_per_layer": local * (k_dim + v_dim),
            "bytes_per_token": num_layers * local * (k_dim + v_dim) * dtype_bytes,  # K and V may differ (MLA's)
            "configured": configured, "hypothetical": not configured}


def add_fits(rows: list[dict[str, Any]], windows: list[int | None], context: int | None,
             memory_bytes: int | None) -> None:
    """Each row's bytes per sequence at `context` (windows applied) and, with a memory budget, how many fit."""
    for row in rows:
        row["kv_bytes_per_sequence"] = None if context is None else per_sequence(row["bytes_per_token"], windows,
                                                                                  context)
        if memory_bytes is not None and row["kv_bytes_per_sequence"]:
            row["max_sequences_in_memory"] = memory_bytes // row["kv_bytes_per_sequence"]


def format_comparison(rows: list[dict[str, Any]], context: int | None) -> list[str]:
    """The table: one line per layout."""
    from kvserve.utils.sizes import format_size

    lines = [f"{'layout':<26}{'KV per token':>16}{'vs configured':>15}"
             + (f"{'per sequence':>16}" if context is not None else "")
             + (f"{'fit':>10}" if any("max_sequences_in_memory" in r for r in rows) else "")]
    for r in rows:
        name = r["attention"] + (f" ({r['num_kv_heads']} KV heads)" if r["num_kv_heads"] else
                                 f" ({r['kv_lora_rank']}+{r['qk_rope_head_dim']})")
        name += " *" if r["hypothetical"] else ""
        line = f"{name:<26}{format_size(r['bytes_per_token']):>16}{r['vs_configured']:>14.2f}x"
        if context is not None:
            line += f"{format_size(r['kv_bytes_per_sequence']):>16}"
        if "max_sequences_in_memory" in r:
            line += f"{r['max_sequences_in_memory']:>10,}"
        lines.append(line)
    lines.append("* hypothetical: the same model with that attention layout (MLA: DeepSeek-V3's 512+64 latent "
                 "where the model has none)")
    return lines
