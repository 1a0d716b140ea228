"""int4 weight-only linear: group-wise asymmetric quantization (a min and a scale per group of `group_size`
input columns) computed at load from the full-precision weight; activations stay float32.

    w[n, k] ~= q[n, k] * scale[n, g] + min[n, g],   q in 0..15,   scale = (max - min) / 15,   g = k // group

Codes are stored two per byte in GGUF's Q4 nibble order, so GGUF Q4_0/Q4_1 blocks run on the same kernel
(kernels.int4_linear). Each layer's input size must be a multiple of the group size.
"""
from __future__ import annotations

import torch
from torch import nn

import kvserve.envs as envs
from kvserve.config.quantization import INT4_GROUP_SIZES
from kvserve.layers.quant import kernels
from kvserve.layers.quant.common import check_group_size, drop_dense_weight, pack_nibbles


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] uint8 in 0..15, scales [N, K/group], mins [N, K/group]) float32."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)       # [N, G, group]
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)                                   # [N, G]
    scales = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.clamp(torch.round((w - lo[..., None]) / scales[..., None]), 0, 15).to(torch.uint8)
    return q.reshape(n, k), scales, lo


class Int4WeightOnlyMethod:
    """Quantizes `layer.weight` group-wise in process_weights_after_loading and frees it."""

    name = "int4"

    def __init__(self, group_size: int = 128):
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        self.group_size = group_size
        self.scratch = kernels.DenseScratch()
        self.fixed_point = envs.quant_fixed_point()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        check_group_size(layer, self.group_size, getattr(layer, "prefix", type(layer).__name__), "int4")
        q, layer.scales, layer.mins = quantize_int4(layer.weight, self.group_size)  # [out, in/group] each
        layer.qweight = pack_nibbles(q)                                      # [out, in / 2] uint8
        layer.group_size = self.group_size
        drop_dense_weight(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return kernels.int4_linear(x, layer.qweight, layer.scales, layer.mins, layer.group_size, bias,
                                   self.scratch, self.fixed_point)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """[out, in] float32: the weight apply multiplies by."""
        return kernels.int4_dequantize(layer.qweight, layer.scales, layer.mins, layer.group_size)
