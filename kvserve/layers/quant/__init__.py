"""Weight-only quantized linear methods (`--quantization int8 | int4 | gguf`).

Only the decoder layers' projections (qkv, o, gate/up, down) are quantized. The token embedding and the LM
head stay in full precision: the embedding is a lookup (one row per token: its bytes are never read in
bulk), and the LM head decides the next token directly, where a weight error is not averaged away by later
layers (vLLM's quantization methods leave lm_head unquantized by default; llama.cpp gives output.weight more
bits than the other tensors). Activations stay float32.
"""
from __future__ import annotations

from torch import nn

from kvserve.config.quantization import QUANTIZATIONS
from kvserve.layers.linear_methods import LinearMethod


def make_linear_method(quantization: str | None, group_size: int, dense: LinearMethod) -> LinearMethod:
    """The decoder layers' method for `quantization` (None: `dense`, the unquantized default)."""
    if quantization is None:
        return dense
    if quantization == "int8":
        from kvserve.layers.quant.int8 import Int8WeightOnlyMethod
        return Int8WeightOnlyMethod()
    if quantization == "int4":
        from kvserve.layers.quant.int4 import Int4WeightOnlyMethod
        return Int4WeightOnlyMethod(group_size)
    if quantization == "gguf":
        from kvserve.layers.quant.gguf import GGUFMethod
        return GGUFMethod(dense)
    raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")


def check_layers(model: nn.Module, quantization: str | None, group_size: int) -> None:
    """Refuse, before any weight is read, a quantization that a layer's shape cannot take (names the layer)."""
    if quantization != "int4":
        return
    from kvserve.layers.linear import LinearBase
    from kvserve.layers.quant.int4 import check_group_size

    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and name != "lm_head":
            check_group_size(module, group_size, name)


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
