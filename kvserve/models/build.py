"""The network for a resolved model config: uninitialised weights of the right shapes on a device."""
from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.layers.linear_methods import LinearMethod
from kvserve.layers.parallel import ShardContext
from kvserve.model_loader.architectures import resolve_architecture
from kvserve.models.deepseek import DeepseekForCausalLM
from kvserve.models.gemma import GemmaForCausalLM
from kvserve.models.llama import LlamaForCausalLM

# ArchFeatures.network -> the class that builds it; each has LlamaForCausalLM's interface.
_NETWORKS = {"llama": LlamaForCausalLM, "gemma": GemmaForCausalLM, "deepseek": DeepseekForCausalLM}


def build_model(hf_config, backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
                device: torch.device, method: LinearMethod, shard: ShardContext = ShardContext(),
                head_method: LinearMethod | None = None) -> LlamaForCausalLM:
    """The network with uninitialised weights on `device` (fill it with weight_loader.load_weights).
    head_method: the LM head's, when it differs from the decoder layers' (quantized layers, full-precision head)."""
    _, feats = resolve_architecture(hf_config)
    network = _NETWORKS[feats.network]
    with torch.device("meta"):
        model = network(hf_config, feats, backend, max_positions, method, shard, head_method)
    model = model.to_empty(device=device).to(dtype)
    for module in model.modules():  # routers whose logits transformers computes from float32 weights
        if getattr(module, "keep_float32", False):
            module.float()
    if model.lm_head.tied:  # to_empty gave the head its own storage: share the embedding's again
        model.lm_head.weight = model.embed_tokens.weight
    # Buffers are not in the checkpoint: recompute the RoPE tables on the real device.
    model.rope = type(model.rope)(hf_config, max_positions).to(device)
    return model
