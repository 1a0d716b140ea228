"""Supported architectures, keyed by the `architectures` field of a Hugging Face config, and what each changes
in the Llama network (models/llama.py). Read when a config is resolved, before any model code is imported."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchFeatures:
    """What distinguishes the supported architectures from plain Llama."""

    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False   # Qwen3: RMSNorm over head_dim on q and k before RoPE


ARCHITECTURES: dict[str, ArchFeatures] = {
    "LlamaForCausalLM": ArchFeatures(),
    "MistralForCausalLM": ArchFeatures(),
    "Qwen2ForCausalLM": ArchFeatures(qkv_bias=True),
    "Qwen3ForCausalLM": ArchFeatures(qk_norm=True),
}


def resolve_architecture(hf_config) -> tuple[str, ArchFeatures]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch, ARCHITECTURES[arch]
    raise ValueError(
        f"unsupported architecture {archs or getattr(hf_config, 'model_type', None)!r}; "
        f"supported: {', '.join(ARCHITECTURES)}")
