"""A PEFT LoRA adapter read from disk and checked against the base model before it can reach a slot.

PEFT stores, per adapted linear `W [out, in]`, `lora_A [r, in]` and `lora_B [out, r]`, and computes
`y = x W^T + (x A^T B^T) * scaling` with scaling = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
(peft/tuners/lora/layer.py, `update_layer`). Every check raises ValueError naming the adapter and the
problem, so a bad adapter fails at admission, not in the middle of a forward pass.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from kvserve.lora.request import LoRARequest

# The checkpoint's (unfused) module names we can adapt, and which side of the decoder layer holds them.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_CONFIG = "adapter_config.json"
_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass
class LoRAAdapter:
    """One adapter's weights in host memory, as PEFT stores them (unscaled, unfused)."""

    lora_int_id: int
    rank: int
    scaling: float
    """lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA; folded into B when the adapter enters a slot."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    """(layer index, module name such as "q_proj") -> (A [r, in], B [out, r])."""

    @property
    def target_modules(self) -> set[str]:
        return {module for _, module in self.weights}


def module_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable module of one decoder layer, as in the checkpoint (before our fusing)."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q = hf_config.num_attention_heads * head_dim
    kv = (getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads) * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def load_adapter(request: LoRARequest, hf_config, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read and check a PEFT adapter folder against the base model's config. Raises ValueError."""
    what = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    config = _read_config(request.lora_path, what)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{what}: adapter_config.json has no valid rank r (got {rank!r})")
    if rank > max_lora_rank:
        raise ValueError(f"{what}: rank {rank} is over max_lora_rank {max_lora_rank} (raise --max-lora-rank)")
    for unsupported in ("use_dora", "fan_in_fan_out"):
        if config.get(unsupported):
            raise ValueError(f"{what}: {unsupported} adapters are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{what}: per-module rank_pattern/alpha_pattern is not supported")
    if config.get("modules_to_save"):
        raise ValueError(f"{what}: modules_to_save (fully trained modules) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{what}: trained biases (bias={config['bias']!r}) are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple, set)):
        lacking = sorted(set(targets) - set(TARGET_MODULES))
        if lacking:
            raise ValueError(f"{what}: target modules {lacking} are not modules of this model that LoRA can adapt "
                             f"(supported: {', '.join(TARGET_MODULES)})")
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _pair_weights(_read_tensors(request.lora_path, what), what)
    _check_shapes(weights, rank, hf_config, what)
    return LoRAAdapter(request.lora_int_id, rank, scaling,
                       {key: (a.to(dtype), b.to(dtype)) for key, (a, b) in weights.items()})


def _read_config(path: str, what: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"{what}: no such folder")
    file = os.path.join(path, _CONFIG)
    if not os.path.isfile(file):
        raise ValueError(f"{what}: missing file {_CONFIG}")
    with open(file) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{what}: peft_type {config['peft_type']!r} is not LORA")
    return config


def _read_tensors(path: str, what: str) -> dict[str, torch.Tensor]:
    st, bin_ = (os.path.join(path, name) for name in _WEIGHTS)
    if os.path.isfile(st):
        from safetensors.torch import load_file
        return load_file(st)
    if os.path.isfile(bin_):
        return torch.load(bin_, map_location="cpu", weights_only=True)
    raise ValueError(f"{what}: missing file {_WEIGHTS[0]} (or {_WEIGHTS[1]})")


def _pair_weights(tensors: dict[str, torch.Tensor], what: str) -> dict[tuple[int, str], list[torch.Tensor]]:
    """Checkpoint names -> (layer, module) -> [A, B]; any tensor we cannot place is an error naming it."""
    pairs: dict[tuple[int, str], list] = {}
    for name, tensor in tensors.items():
        m = _KEY.search(name)
        if m is None:
            raise ValueError(f"{what}: tensor {name} is not a lora_A/lora_B weight of a decoder layer module")
        layer, module, side = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGET_MODULES:
            raise ValueError(f"{what}: targets module {module!r}, which this model lacks or LoRA cannot adapt "
                             f"(supported: {', '.join(TARGET_MODULES)})")
        pairs.setdefault((layer, module), [None, None])["AB".index(side)] = tensor
    for (layer, module), (a, b) in pairs.items():
        if a is None or b is None:
            raise ValueError(f"{what}: layer {layer} {module} has lora_{'A' if a is None else 'B'} missing")
    if not pairs:
        raise ValueError(f"{what}: no LoRA weights in the adapter file")
    return pairs


def _check_shapes(weights, rank: int, hf_config, what: str) -> None:
    shapes = module_shapes(hf_config)
    num_layers = hf_config.num_hidden_layers
    for (layer, module), (a, b) in weights.items():
        if layer >= num_layers:
            raise ValueError(f"{what}: has weights for layer {layer}, but the model has {num_layers} layers "
                             "(an adapter of another base model?)")
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise ValueError(f"{what}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}, expected {(rank, fan_in)} and {(fan_out, rank)} for this base "
                             "model (an adapter of another base model?)")
