"""Supported architectures, keyed by the `architectures` field of a Hugging Face config."""
from __future__ import annotations

from kvserve.models.llama import ArchFeatures

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
