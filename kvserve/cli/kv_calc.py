"""`kvserve kv-calc`: how much memory the KV cache of a model needs, and how many sequences fit.

KV bytes per token = 2 (K and V) × layers × KV heads × head_dim × bytes per element; a quantized cache
(`--kv-cache-dtype int8 | fp8_e4m3`, the engine's flag) adds one 2-byte (bfloat16) scale per KV block of
`--block-size` tokens and KV head (a fraction of a byte per token), and the report says how many times the tokens
of the unquantized `--kv-dtype` it holds. Grouped-query
attention shows up through `num_key_value_heads` (MHA when absent, MQA when 1); GPT-2/Falcon-style configs
(`n_layer`, `n_head`, `n_embd`, `multi_query`, `num_kv_heads`/`n_head_kv`) are read too (kv_cache/sizing.py).

`--tensor-parallel-size N` gives one rank's figures: each holds its 1/N of the KV heads (one replicated KV
head when there are fewer heads than ranks), so --memory is one rank's budget too.

The shape can also come from flags alone, no checkpoint needed (`--num-layers --num-kv-heads --head-dim`);
with `--model`, the flags override the file's values. `--model` also takes a preset name (kv_presets.py:
deepseek-v3, qwen3-30b-a3b, gemma-3-27b, mixtral-8x7b, ...): config fields only, sized like a file.

Newer layouts (kv_compare.py): an MLA model (kv_lora_rank + qk_rope_head_dim: DeepSeek-V2/V3, Kimi) caches one
latent vector a token and layer, layers × (kv_lora_rank + qk_rope_head_dim) × bytes, replicated on every
tensor-parallel rank; a sliding-window layer keeps min(context, W) tokens of a sequence, so per-sequence figures
(and how many fit) are given with and without the windows; a Mixture-of-Experts model's KV is a dense one's, but
its weights (model_loader/param_count.py: total, and active per token) are what `--device-memory` leaves the
cache. Every report ends with the MHA / GQA / MLA comparison for the same model.

`--json` fields (stable): everything the report prints, among them `kv_bytes_per_token` (alias
`bytes_per_token`), `attention` (MHA / GQA / MQA / MLA), `kv_lora_rank`, `qk_rope_head_dim`, `sliding_window`,
`num_sliding_layers`, `kv_bytes_per_sequence` (windows applied) and `kv_bytes_per_sequence_without_windows`,
`max_sequences_in_memory` (and `_without_windows`), `params_total`, `params_active`, `num_experts`,
`experts_per_token`, `weight_bytes_total`, `weight_bytes_active`, and `comparison`: one row per layout with
`attention`, `num_kv_heads`, `bytes_per_token`, `kv_bytes_per_sequence`, `max_sequences_in_memory`, `configured`,
`hypothetical`, `vs_configured`.

Registered as a subcommand by `kvserve/cli/main.py` through `add_arguments` and `run`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from kvserve.cli import kv_compare
from kvserve.cli.kv_presets import PRESETS, preset
from kvserve.kv_cache.sizing import (CONTEXT_KEYS, NUM_HEADS_KEYS, NUM_LAYERS_KEYS, attention_shape, config_get,
                                     first_key, kv_bytes, kv_bytes_per_token, mla_latent, num_query_heads)
from kvserve.model_loader.param_count import param_count
from kvserve.utils.sizes import format_size, parse_size

__all__ = ["KV_DTYPE_BYTES", "add_arguments", "run", "kv_bytes_per_token", "load_model_config"]

# Bytes per KV element; "auto" is resolved from the model config (see _resolve_kv_dtype).
KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}
# Bytes per weight; "auto" is the model config's dtype (float16 when it has none), as for the KV cache.
WEIGHT_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
# The engine's quantized caches (kv_cache/quant.py, which imports torch: not imported here): one byte per
# element, one bfloat16 scale per block, KV head and K/V.
QUANTIZED_KV_CACHE_DTYPES = ("int8", "fp8", "fp8_e4m3")
KV_SCALE_BYTES = 2
# Spellings of torch dtypes that can appear in config.json's "torch_dtype" / "dtype".
_CONFIG_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}
_EXIT_USAGE = 2  # argparse's exit status for bad arguments; we use it for every user error
# shape flag -> the Llama config key it sets (those keys win over GPT-2/Falcon aliases in sizing.py)
_SHAPE_FLAGS = {"num_layers": "num_hidden_layers", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
                "num_heads": "num_attention_heads"}
_REQUIRED_WITHOUT_MODEL = ("num_layers", "num_kv_heads", "head_dim")


def load_model_config(model: str) -> Any:
    """Load a model config from a HF folder, a config.json path, a `.gguf` file or a preset name (kv_presets.py).

    Returns a dict for config.json (so any architecture's fields can be read, not only those
    transformers knows) and a `LlamaConfig` for GGUF files. Multimodal configs that nest the
    language model under `text_config` return that nested dict.

    Raises:
        FileNotFoundError: the path, or config.json inside the folder, does not exist.
        ValueError: the file is not valid JSON / GGUF.
    """
    if os.path.isdir(model):
        config_path = os.path.join(model, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"model folder {model} has no config.json")
    elif os.path.isfile(model):
        if model.endswith(".gguf"):
            from kvserve.model_loader.gguf_loader import load_gguf_config  # imports torch: only when needed

            return load_gguf_config(model)
        config_path = model
    elif preset(model) is not None:
        return preset(model)
    else:
        raise FileNotFoundError(f"model not found: {model} (expected a HF model folder, a config.json, a .gguf file "
                                f"or a preset: {', '.join(PRESETS)})")

    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    if first_key(config, NUM_LAYERS_KEYS) is None and isinstance(config.get("text_config"), dict):
        text_config = dict(config["text_config"])
        for key in ("torch_dtype", "dtype"):
            text_config.setdefault(key, config.get(key))
        return text_config
    return config


def _resolve_kv_dtype(kv_dtype: str, config: Any) -> str:
    if kv_dtype != "auto":
        if kv_dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"--kv-dtype must be one of auto, {', '.join(KV_DTYPE_BYTES)}; got {kv_dtype!r}")
        return kv_dtype
    # transformers 5 writes "dtype", 4.x "torch_dtype"; GGUF configs have neither.
    config_dtype = config_get(config, "dtype") or config_get(config, "torch_dtype")
    if config_dtype is None:
        return "float16"
    name = str(config_dtype).removeprefix("torch.")
    if name not in _CONFIG_DTYPE_NAMES:
        raise ValueError(f"cannot derive a KV dtype from the model's dtype {name!r}; pass --kv-dtype explicitly")
    return _CONFIG_DTYPE_NAMES[name]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `kv-calc` flags to `parser` (a subcommand parser or a standalone one)."""
    parser.add_argument(
        "--model",
        default=None,
        help="HF model folder (with config.json), a config.json file, a .gguf file, or a preset name "
        f"({', '.join(PRESETS)}) (default: none: the shape comes from --num-layers, --num-kv-heads and --head-dim)",
    )
    shape = parser.add_argument_group(
        "model shape", "without --model, --num-layers, --num-kv-heads and --head-dim are required; "
        "with it, each flag given overrides the file's value"
    )
    shape.add_argument("--num-layers", type=int, default=None, help="decoder layers (default: the model's)")
    shape.add_argument("--num-kv-heads", type=int, default=None, help="KV heads per layer (default: the model's)")
    shape.add_argument("--head-dim", type=int, default=None, help="elements per head (default: the model's)")
    shape.add_argument(
        "--num-heads", type=int, default=None,
        help="query heads per layer: MHA/GQA/MQA in the report (default: the model's; none without --model)",
    )
    parser.add_argument(
        "--context", type=int, default=None, help="tokens per sequence (default: the model's max_position_embeddings)"
    )
    parser.add_argument("--batch", type=int, default=1, help="number of sequences (default: 1)")
    parser.add_argument(
        "--memory",
        default=None,
        help="memory available for the KV cache, e.g. 2GiB, 512MiB, 80GB, 1e9 (default: none: no fit count)",
    )
    parser.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", *KV_DTYPE_BYTES],
        help="KV element type (default: auto, the model's dtype; float16 when it has none); with "
        "--kv-cache-dtype int8/fp8_e4m3, the unquantized cache the capacity is compared with",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", *QUANTIZED_KV_CACHE_DTYPES],
        help="the engine's --kv-cache-dtype: int8 or fp8_e4m3 size a quantized cache (1 byte per element plus "
        f"a {KV_SCALE_BYTES}-byte scale per block and KV head, for K and V); default: auto, --kv-dtype's elements",
    )
    parser.add_argument(
        "--block-size", type=int, default=16,
        help="tokens per KV block (the engine's flag): a quantized cache holds one scale per block (default: 16)",
    )
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="ranks the model is sharded over (the engine's flag): each holds its share of the KV heads (a KV "
        "head is replicated when there are fewer than ranks), and every figure, --memory included, is per rank",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of a report")
    _add_weight_arguments(parser)


def _add_weight_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that weigh the model's weights against the cache."""
    parser.add_argument(
        "--device-memory",
        default=None,
        help="the accelerator's whole memory, e.g. 80GB: the KV cache gets what the weights (--weight-dtype; "
        "each rank's 1/N under --tensor-parallel-size) leave of it; instead of --memory (default: none)",
    )
    parser.add_argument(
        "--weight-dtype",
        default="auto",
        choices=["auto", *WEIGHT_DTYPE_BYTES],
        help="bytes per weight for the weight figures (int4: half a byte); default: auto, the model's dtype",
    )


def _shape_config(args: argparse.Namespace) -> Any:
    """The model's config (when --model is given) with the shape flags laid over it."""
    given = {flag: getattr(args, flag) for flag in _SHAPE_FLAGS if getattr(args, flag) is not None}
    for flag, value in given.items():
        if value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if args.model is None:
        missing = [f"--{flag.replace('_', '-')}" for flag in _REQUIRED_WITHOUT_MODEL if flag not in given]
        if missing:
            raise ValueError(f"without --model, pass the shape as flags: missing {', '.join(missing)}")
        config: Any = {}
    else:
        config = load_model_config(args.model)
    if not given:
        return config
    # NOTE: the flags set Llama's keys, which sizing.py reads before any GPT-2/Falcon alias.
    base = dict(config) if isinstance(config, dict) else config.to_dict()
    return base | {_SHAPE_FLAGS[flag]: value for flag, value in given.items()}


def _validated_memory(args: argparse.Namespace) -> int | None:
    """--memory in bytes (None when absent), after the checks on every numeric flag."""
    for flag in ("batch", "block_size"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    if args.context is not None and args.context <= 0:
        raise ValueError(f"--context must be a positive integer, got {args.context}")
    if args.memory is not None and getattr(args, "device_memory", None) is not None:
        raise ValueError("pass --memory (the KV cache's) or --device-memory (the whole device's), not both")
    for flag in ("memory", "device_memory"):
        text = getattr(args, flag, None)
        if text is not None and parse_size(text) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {text!r}")
    return None if args.memory is None else parse_size(args.memory)


def _context(args: argparse.Namespace, config: Any) -> int | None:
    if args.context is not None:
        return args.context
    key = first_key(config, CONTEXT_KEYS)
    context = None if key is None else config_get(config, key)
    # NOTE: no length to size a sequence by: the per-token figures still stand
    return context if isinstance(context, int) and context > 0 else None


def _compute(args: argparse.Namespace) -> dict[str, Any]:
    """The report as a dict; raises FileNotFoundError/ValueError on user errors."""
    memory_bytes = _validated_memory(args)
    config = _shape_config(args)
    kv_dtype = _resolve_kv_dtype(args.kv_dtype, config)
    dtype_bytes = KV_DTYPE_BYTES[kv_dtype]
    num_layers, num_kv_heads, head_dim = attention_shape(config)
    latent = mla_latent(config)
    per_token = kv_bytes_per_token(config, dtype_bytes)
    quantized = args.kv_cache_dtype != "auto"
    if quantized and latent is not None:
        raise ValueError("--kv-cache-dtype int8/fp8_e4m3 sizes K/V heads; an MLA latent cache is not quantized")
    if quantized:
        unquantized_per_token = per_token
        per_token = _per_token(kv_bytes(num_layers, num_kv_heads, head_dim * args.block_size, 1, KV_SCALE_BYTES),
                               args.block_size)
    num_heads = None if first_key(config, NUM_HEADS_KEYS) is None else num_query_heads(config)
    tp = args.tensor_parallel_size
    whole_per_token = per_token
    per_token = _rank_per_token(per_token, num_kv_heads, tp, latent is not None)

    context = _context(args, config)
    windows = kv_compare.layer_windows(config, num_layers)
    per_sequence = kv_compare.per_sequence(per_token, windows, context) if context is not None else None
    report: dict[str, Any] = {
        "model": args.model,
        "num_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "attention": _attention_kind(num_heads, num_kv_heads, latent),
        "kv_lora_rank": latent[0] if latent else None,
        "qk_rope_head_dim": latent[1] if latent else None,
        "kv_dtype": args.kv_cache_dtype if quantized else kv_dtype,
        "kv_dtype_bytes": 1 if quantized else dtype_bytes,
        "kv_scale_bytes": KV_SCALE_BYTES if quantized else 0,
        "block_size": args.block_size,
        "kv_bytes_per_token": per_token,
        "bytes_per_token": per_token,
        "tensor_parallel_size": tp,
        "kv_heads_per_rank": num_kv_heads if latent else max(1, num_kv_heads // tp),
        "kv_bytes_per_token_all_ranks": per_token * tp if tp > 1 else whole_per_token,
        "context": context,
        "batch": args.batch,
        "kv_bytes_per_sequence": per_sequence,
        "kv_bytes_total": None if per_sequence is None else per_sequence * args.batch,
        "kv_gib_total": None if per_sequence is None else per_sequence * args.batch / 1024**3,
    }
    if quantized:
        report["unquantized_kv_dtype"] = kv_dtype
        report["unquantized_kv_bytes_per_token"] = unquantized_per_token
        report["capacity_gain"] = unquantized_per_token / per_token
    _add_windows(report, windows, per_token)
    memory_bytes = _add_weights(report, config, args, memory_bytes)
    _add_memory_fit(report, memory_bytes)
    report["comparison"] = None  # NOTE: no query-head count (flags without --num-heads): no MHA to compare with
    if num_heads is not None:
        report["comparison"] = kv_compare.comparison(config, num_layers, dtype_bytes, tp)
        kv_compare.add_fits(report["comparison"], windows, context, memory_bytes)
    return report


def _rank_per_token(per_token: int | float, num_kv_heads: int, tp: int, mla: bool) -> int | float:
    """One rank's bytes per token: its share of the KV heads (one replicated head when there are fewer heads
    than ranks); an MLA latent is every head's, so each rank holds all of it."""
    if tp == 1:
        return per_token
    if tp < 1 or (not mla and num_kv_heads % tp and tp % num_kv_heads):
        raise ValueError(f"--tensor-parallel-size {tp} can neither split nor replicate {num_kv_heads} KV heads "
                         f"(it must divide {num_kv_heads} or be a multiple of it)")
    return per_token if mla else _per_token(per_token * max(1, num_kv_heads // tp), num_kv_heads)


def _attention_kind(num_heads: int | None, num_kv_heads: int, latent: tuple[int, int] | None) -> str | None:
    if latent is not None:
        return "MLA"
    if num_heads is None:  # shape from flags without --num-heads: the kind of attention is unknown
        return None
    return "MHA" if num_kv_heads == num_heads else "MQA" if num_kv_heads == 1 else "GQA"


def _add_windows(report: dict[str, Any], windows: list[int | None], per_token: float) -> None:
    """The sliding windows, and what a sequence would cost without them."""
    windowed = [w for w in windows if w is not None]
    report["sliding_window"] = max(windowed) if windowed else None
    report["num_sliding_layers"] = len(windowed)
    if windowed and report["context"] is not None:
        report["kv_bytes_per_sequence_without_windows"] = math.ceil(per_token * report["context"])


def _add_weights(report: dict[str, Any], config: Any, args: argparse.Namespace, memory_bytes: int | None
                 ) -> int | None:
    """Parameters and weight bytes (total and per token); with --device-memory, the KV budget they leave."""
    params = param_count(config)
    if params is None:
        if args.device_memory is not None:
            raise ValueError("--device-memory needs the model's parameter count, which this config does not give "
                             "(a Llama-family config with hidden_size, intermediate_size and vocab_size); use --memory")
        return memory_bytes
    weight_dtype = args.weight_dtype
    if weight_dtype == "auto":
        try:
            weight_dtype = _resolve_kv_dtype("auto", config)
        except ValueError as exc:
            raise ValueError(f"{exc} (and --weight-dtype)") from exc
    weight_bytes = WEIGHT_DTYPE_BYTES[weight_dtype]
    report.update(params_total=params.total, params_active=params.active, num_experts=params.num_experts,
                  experts_per_token=params.experts_per_token, num_moe_layers=params.num_moe_layers,
                  weight_dtype=weight_dtype, weight_bytes_total=math.ceil(params.total * weight_bytes),
                  weight_bytes_active=math.ceil(params.active * weight_bytes))
    if args.device_memory is None:
        return memory_bytes
    device = parse_size(args.device_memory)
    per_rank = math.ceil(report["weight_bytes_total"] / args.tensor_parallel_size)
    if per_rank >= device:
        raise ValueError(f"the weights ({format_size(per_rank)} a rank) do not fit in --device-memory "
                         f"{args.device_memory}: nothing is left for the KV cache")
    report.update(device_memory_bytes=device, weight_bytes_per_rank=per_rank)
    return device - per_rank


def _add_memory_fit(report: dict[str, Any], memory_bytes: int | None) -> None:
    if memory_bytes is None:
        return
    per_token, per_sequence = report["kv_bytes_per_token"], report["kv_bytes_per_sequence"]
    report["memory_bytes"] = memory_bytes
    report["max_tokens_in_memory"] = int(memory_bytes // per_token)
    if per_sequence is not None:
        report["max_sequences_in_memory"] = memory_bytes // per_sequence
        report["batch_fits"] = per_sequence * report["batch"] <= memory_bytes
    if "kv_bytes_per_sequence_without_windows" in report:
        report["max_sequences_in_memory_without_windows"] = \
            memory_bytes // report["kv_bytes_per_sequence_without_windows"]


def _per_token(total: int, count: int) -> int | float:
    """total / count: an int when it divides (a quantized cache's scales are a fraction of a byte per token)."""
    return total // count if total % count == 0 else total / count


def _format_report(r: dict[str, Any]) -> str:
    num_heads, num_kv_heads = r["num_attention_heads"], r["num_kv_heads"]
    if r["attention"] == "MLA":
        heads = (f"{num_heads} heads, MLA: one latent of {r['kv_lora_rank']} + {r['qk_rope_head_dim']} (RoPE) "
                 "elements a token and layer")
    elif num_heads is None:  # shape from flags without --num-heads: the kind of attention is unknown
        heads = f"{num_kv_heads} KV heads, head_dim {r['head_dim']}"
    else:
        heads = f"{num_heads} heads, {num_kv_heads} KV heads ({r['attention']}), head_dim {r['head_dim']}"
    lines = [
        f"model            {r['model'] or '(none: the shape from flags)'}",
        f"attention        {r['num_layers']} layers, {heads}",
    ]
    if r["sliding_window"] is not None:
        lines.append(f"sliding window   {r['num_sliding_layers']} of {r['num_layers']} layers keep the last "
                     f"{r['sliding_window']:,} tokens")
    lines += [
        f"KV dtype         {r['kv_dtype']} ({r['kv_dtype_bytes']} bytes)" + (
            f" + a {r['kv_scale_bytes']}-byte scale per block of {r['block_size']} tokens and KV head, for K and V"
            if r["kv_scale_bytes"] else ""),
        f"KV per token     {r['kv_bytes_per_token']:,} bytes ({format_size(r['kv_bytes_per_token'])})",
    ]
    if r.get("tensor_parallel_size", 1) > 1:
        lines.append(f"tensor parallel  {r['tensor_parallel_size']} ranks, {r['kv_heads_per_rank']} KV heads each: "
                     f"the figures are per rank ({r['kv_bytes_per_token_all_ranks']:,} bytes per token on all ranks)")
    lines += _format_sequences(r) + _format_weights(r) + _format_memory(r)
    if r["comparison"]:
        lines += ["", "attention layouts of the same model (per rank, at the KV dtype):"]
        lines += kv_compare.format_comparison(r["comparison"], r["context"])
    return "\n".join(lines)


def _format_sequences(r: dict[str, Any]) -> list[str]:
    if r["context"] is None:
        return ["KV per sequence  (no --context and no max_position_embeddings: pass --context for it)"]
    lines = [f"KV per sequence  {r['kv_bytes_per_sequence']:,} bytes at {r['context']:,} tokens "
             f"({format_size(r['kv_bytes_per_sequence'])})"]
    if "kv_bytes_per_sequence_without_windows" in r:
        lines.append(f"  no windows     {r['kv_bytes_per_sequence_without_windows']:,} bytes "
                     f"({format_size(r['kv_bytes_per_sequence_without_windows'])}) if every layer kept every token")
    lines.append(f"KV total         {r['kv_bytes_total']:,} bytes for batch {r['batch']} ({r['kv_gib_total']:.3f} GiB)")
    if "capacity_gain" in r:
        lines.append(f"capacity         {r['capacity_gain']:.2f}x the tokens of a {r['unquantized_kv_dtype']} cache "
                     f"({r['unquantized_kv_bytes_per_token']:,} bytes per token)")
    return lines


def _format_weights(r: dict[str, Any]) -> list[str]:
    if "params_total" not in r:
        return []
    weights = (f"weights          {r['params_total'] / 1e9:,.2f}B parameters, {format_size(r['weight_bytes_total'])} "
               f"in {r['weight_dtype']}")
    if not r["num_experts"]:
        return [weights]
    return [weights, f"  per token      {r['params_active'] / 1e9:,.2f}B active ({format_size(r['weight_bytes_active'])}"
            f"): {r['experts_per_token']} of {r['num_experts']} experts in {r['num_moe_layers']} MoE layers; "
            "every expert stays in memory"]


def _format_memory(r: dict[str, Any]) -> list[str]:
    lines = []
    if "device_memory_bytes" in r:
        lines.append(f"device           {format_size(r['device_memory_bytes'])} less "
                     f"{format_size(r['weight_bytes_per_rank'])} of weights a rank")
    if "memory_bytes" in r and "batch_fits" in r:
        fits = "fits" if r["batch_fits"] else "does NOT fit"
        lines += [
            f"memory           {r['memory_bytes']:,} bytes ({format_size(r['memory_bytes'])}): batch {r['batch']} {fits}",
            f"fits             {r['max_sequences_in_memory']:,} sequences of {r['context']:,} tokens "
            f"({r['max_tokens_in_memory']:,} tokens in all)",
        ]
        if "max_sequences_in_memory_without_windows" in r:
            lines.append(f"  no windows     {r['max_sequences_in_memory_without_windows']:,} sequences")
    elif "memory_bytes" in r:
        lines.append(f"memory           {r['memory_bytes']:,} bytes ({format_size(r['memory_bytes'])}): "
                     f"{r['max_tokens_in_memory']:,} tokens in all")
    return lines


def run(args: argparse.Namespace) -> int:
    """Run `kv-calc` with parsed `args`; print the report (or JSON) and return the exit status.

    Returns 0 on success and 2 on a user error (missing file, bad size, non-positive
    context/batch), after printing the reason to stderr.
    """
    try:
        report = _compute(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"kvserve kv-calc: error: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_format_report(report))
    return 0


if __name__ == "__main__":  # for development only; users go through `kvserve kv-calc`
    from kvserve.cli.standalone import standalone_main

    sys.exit(standalone_main("kvserve kv-calc", __doc__.splitlines()[0], add_arguments, run))
