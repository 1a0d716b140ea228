"""A replicated linear layer loaded through a linear method, and transformers models holding the weights a
quantized engine computes with, for the quantized-method tests."""
from __future__ import annotations

import copy

import torch

from kvserve.layers.linear import ReplicatedLinear


def linear_layer(w: torch.Tensor, method, bias: torch.Tensor | None = None, loaded=None) -> ReplicatedLinear:
    """`w` (or `loaded`, a packed form of it) and `bias` loaded into a ReplicatedLinear using `method`."""
    layer = ReplicatedLinear(w.shape[1], w.shape[0], bias is not None, method)
    layer.weight_loader("weight", w if loaded is None else loaded)
    if bias is not None:
        layer.weight_loader("bias", bias)
    layer.process_weights_after_loading()
    return layer


LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dequantized_copy(hf_model, method_factory, head: bool = True, expert_group: int | None = None):
    """The HF model with every decoder linear weight replaced by the weight its quantized method computes with,
    and (head) the LM head by its int8 group-32 weight; a tied model comes back untied, the embedding as it was.
    expert_group: also each stacked expert matrix (transformers' `gate_up_proj` / `down_proj` [E, N, K]) by
    its int8 weight with that group size, as FusedMoE quantizes them under --quantization int8."""
    from kvserve.layers.moe_fused import quantize_experts
    from kvserve.layers.quant.int8 import Int8WeightOnlyMethod

    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEAR_NAMES:
                method = method_factory()
                layer = linear_layer(module.weight.detach().clone(), method)
                module.weight.copy_(method.dequantized_weight(layer))
            if expert_group is not None and hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
                for p in (module.gate_up_proj, module.down_proj):
                    p.copy_(quantize_experts(p.detach(), expert_group).dequantized())
        if head:
            method = Int8WeightOnlyMethod(32)
            layer = linear_layer(model.lm_head.weight.detach().clone(), method)
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(method.dequantized_weight(layer))
    return model


def quant_kernels_for(isa: str, monkeypatch):
    """The quantized-linear C++ module built for `isa` (KVSERVE_CPU_ISA's variant), installed as
    kvserve.layers.quant.kernels' module for the rest of the test (None: it does not build here). Only this one
    kernel changes variant: the other kernels a test loads stay the selected ISA's builds. The shape cache that
    depends on the module is cleared now; callers clear it again when the test ends (`kernels.tiles_fit`)."""
    from kvserve.layers.quant import kernels

    with monkeypatch.context() as env:
        env.setenv("KVSERVE_CPU_ISA", isa)
        kernels._module.cache_clear()
        module = kernels._module()
    kernels._module.cache_clear()
    monkeypatch.setattr(kernels, "_module", lambda: module)
    kernels.tiles_fit.cache_clear()
    return module
