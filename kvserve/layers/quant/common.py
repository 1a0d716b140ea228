"""What the quantized linear methods share."""
from __future__ import annotations

import torch
from torch import nn


def drop_dense_weight(layer: nn.Module) -> None:
    """Free the full-precision weight once a quantized copy holds it (the point of quantizing is the
    bytes). NOTE: an empty tensor of the same dtype and device stays, so code that reads
    `layer.weight.dtype` / `.device` (the LoRA wrapper) still works; its shape is [0]."""
    w = layer.weight
    layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] codes 0..15 -> [N, K / 2] uint8 in GGUF's Q4 order: in each run of 32 weights, byte j holds
    weight j in its low nibble and weight j + 16 in its high nibble."""
    n, k = q.shape
    runs = q.to(torch.uint8).reshape(n, k // 32, 2, 16)                       # [N, K/32, lo|hi, 16]
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)
