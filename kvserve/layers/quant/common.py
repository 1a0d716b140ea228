"""What the quantized linear methods share."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.config.quantization import GROUP_SIZES


def drop_dense_weight(layer: nn.Module) -> None:
    """Free the full-precision weight once a quantized copy holds it (the point of quantizing is the
    bytes). NOTE: an empty tensor of the same dtype and device stays, so code that reads
    `layer.weight.dtype` / `.device` (the LoRA wrapper) still works; its shape is [0]."""
    w = layer.weight
    layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)


def check_group_size(layer: nn.Module, group_size: int, layer_name: str, method: str) -> None:
    """Refuse, at start-up, a layer whose input size the group does not divide."""
    if layer.input_size % group_size:
        raise ValueError(f"--quantization {method}: group size {group_size} does not divide the input size "
                         f"{layer.input_size} of layer {layer_name} ([{layer.output_size}, {layer.input_size}]); "
                         f"choose a --quantization-group-size from {GROUP_SIZES} that divides it"
                         + (" (or -1: one scale per output channel)" if method == "int8" else ""))


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] codes 0..15 -> [N, K / 2] uint8 in GGUF's Q4 order: in each run of 32 weights, byte j holds
    weight j in its low nibble and weight j + 16 in its high nibble."""
    n, k = q.shape
    runs = q.to(torch.uint8).reshape(n, k // 32, 2, 16)                       # [N, K/32, lo|hi, 16]
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)
