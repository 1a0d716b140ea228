"""int8 weight-only linear: per-output-channel symmetric scales computed at load from the full-precision
weight; activations stay float32.

    w[n, k] ~= q[n, k] * scale[n],   q in [-127, 127],   scale[n] = max_k |w[n, k]| / 127

The matmul is kernels.int8_linear (our AVX-512 kernel at decode sizes, a dequantized dense matmul at
prefill sizes). PyTorch's `_weight_int8pack_mm` is fast only with bfloat16 activations, which would round
every layer's input; with float32 ones it runs scalar code (`python -m kvserve.layers.quant.bench`).
"""
from __future__ import annotations

import torch
from torch import nn

from kvserve.layers.quant import kernels
from kvserve.layers.quant.common import drop_dense_weight


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (q [N, K] int8, scales [N, 1] float32)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0     # [N, 1]
    q = torch.clamp(torch.round(w / scales), -127, 127).to(torch.int8)
    return q, scales


class Int8WeightOnlyMethod:
    """Quantizes `layer.weight` in process_weights_after_loading and frees it; apply runs the int8 kernel."""

    name = "int8"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.qweight, layer.scales = quantize_int8(layer.weight)            # [out, in] int8, [out, 1]
        drop_dense_weight(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return kernels.int8_linear(x, layer.qweight, layer.scales, layer.qweight.shape[1], bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """[out, in] float32: the weight apply multiplies by."""
        return kernels.int8_dequantize(layer.qweight, layer.scales, layer.qweight.shape[1])
