"""Weight-only quantized linear methods (`--quantization int8 | int4 | gguf`).

The decoder layers' projections (qkv, o, gate/up, down) run the chosen method. The LM head runs int8 with a
scale per 32 inputs (GGUF's Q8_0, the type llama.cpp stores the output matrix in) unless
`--no-quantize-lm-head`: it is read in full every decode step, and in float32 SmolLM2's tied 49152 x 576
head is as many bytes as all its int8 decoder layers (docs/features/quantization.md has its quality cost). The token
embedding stays in full precision: it is a lookup (one row per token: its bytes are never read in bulk), so
a tied head holds its own int8 copy beside it. Activations stay float32 (inside the C++ kernel at one or two
rows, a 16-bit fixed-point copy per 32 columns unless KVSERVE_QUANT_FIXED_POINT=0: kernels.py).
"""
from __future__ import annotations

from torch import nn

from kvserve.config.quantization import LM_HEAD_GROUP_SIZE, PER_CHANNEL, QUANTIZATIONS, QuantizationConfig
from kvserve.layers.linear_methods import LinearMethod


def make_linear_method(quantization: str | None, group_size: int, dense: LinearMethod) -> LinearMethod:
    """The decoder layers' method for `quantization` (None: `dense`, the unquantized default)."""
    if quantization is None:
        return dense
    if quantization == "int8":
        from kvserve.layers.quant.int8 import Int8WeightOnlyMethod
        return Int8WeightOnlyMethod(group_size)
    if quantization == "int4":
        from kvserve.layers.quant.int4 import Int4WeightOnlyMethod
        return Int4WeightOnlyMethod(group_size)
    if quantization == "gguf":
        from kvserve.layers.quant.gguf import GGUFMethod
        return GGUFMethod(dense)
    raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")


def make_head_method(quant: QuantizationConfig, hidden_size: int, dense: LinearMethod) -> LinearMethod:
    """The LM head's method: int8 group LM_HEAD_GROUP_SIZE under a quantization (unless quant.lm_head is off or
    the group does not divide the hidden size: then `dense`, which the start-up log shows)."""
    if quant.method is None or not quant.lm_head or hidden_size % LM_HEAD_GROUP_SIZE:
        return dense
    from kvserve.layers.quant.int8 import Int8WeightOnlyMethod
    return Int8WeightOnlyMethod(LM_HEAD_GROUP_SIZE)


def check_layers(model: nn.Module, quantization: str | None, group_size: int) -> None:
    """Refuse, before any weight is read, a quantization that a layer's shape cannot take (names the layer)."""
    if quantization not in ("int4", "int8") or group_size == PER_CHANNEL:
        return
    from kvserve.layers.linear import LinearBase
    from kvserve.layers.quant.common import check_group_size

    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and name != "lm_head":
            check_group_size(module, group_size, name, quantization)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight tensor the model holds: parameters and the tensors methods attach to layers
    (quantized codes, scales, prepacked copies); a tied or shared tensor counts once."""
    import torch

    seen, total = set(), 0
    for module in model.modules():
        tensors = list(module.parameters(recurse=False))
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t.device.type == "meta":
                continue
            # NOTE: oneDNN's prepacked weights are opaque (no storage to ask): counted by their own size.
            key = (t.data_ptr(), t.storage_offset()) if t.layout == torch.strided and not t.is_mkldnn else id(t)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def step_cost_knee(quant: QuantizationConfig, device_type: str) -> int:
    """Step tokens up to which a step of this model costs more per token (the quantized kernels' register
    path, kernels.small_rows()), for the scheduler's step-cost model; 0: the model has no such knee."""
    if quant.method is None or device_type != "cpu":
        return 0
    from kvserve.layers.quant import kernels
    return kernels.small_rows()
