"""int8 weight-only linear: symmetric scales computed at load from the full-precision weight, one per group
of `group_size` input columns (the default 32: GGUF's Q8_0 layout) or one per output channel (group -1);
activations stay float32.

    w[n, k] ~= q[n, k] * scale[n, g],   q in [-127, 127],   scale[n, g] = max_{k in g} |w[n, k]| / 127

The matmul is kernels.int8_linear (our AVX-512 kernel at decode sizes, a dequantized dense matmul at
prefill sizes; at one or two rows of x it rounds them to 16-bit fixed point unless
KVSERVE_QUANT_FIXED_POINT=0, see kernels.py); a per-channel weight runs it with one group spanning the row. PyTorch's
`_weight_int8pack_mm` is fast only with bfloat16 activations, which would round every layer's input; with
float32 ones it runs scalar code (`python -m kvserve.layers.quant.bench`).
"""
from __future__ import annotations

import torch
from torch import nn

import kvserve.envs as envs
from kvserve.config.quantization import GROUP_SIZES, PER_CHANNEL
from kvserve.layers.quant import kernels
from kvserve.layers.quant.common import check_group_size, drop_dense_weight


def quantize_int8(weight: torch.Tensor, group_size: int = PER_CHANNEL) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (q [N, K] int8, scales [N, K / group] float32; [N, 1] per channel)."""
    n, k = weight.shape
    group = k if group_size == PER_CHANNEL else group_size
    w = weight.detach().float().reshape(n, k // group, group)                # [N, G, group]
    scales = w.abs().amax(dim=-1).clamp(min=1e-12) / 127.0                    # [N, G]
    q = torch.clamp(torch.round(w / scales[..., None]), -127, 127).to(torch.int8)
    return q.reshape(n, k), scales


class Int8WeightOnlyMethod:
    """Quantizes `layer.weight` in process_weights_after_loading and frees it; apply runs the int8 kernel."""

    name = "int8"

    def __init__(self, group_size: int = PER_CHANNEL):
        if group_size != PER_CHANNEL and group_size not in GROUP_SIZES:
            raise ValueError(f"int8 group size must be one of {GROUP_SIZES} or -1 (per channel), got {group_size}")
        self.group_size = group_size
        self.scratch = kernels.DenseScratch()
        self.fixed_point = envs.quant_fixed_point()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.group_size != PER_CHANNEL:
            check_group_size(layer, self.group_size, getattr(layer, "prefix", type(layer).__name__), "int8")
        layer.qweight, layer.scales = quantize_int8(layer.weight, self.group_size)  # [out, in] int8, [out, G]
        drop_dense_weight(layer)

    def _group(self, layer: nn.Module) -> int:
        return layer.qweight.shape[1] // layer.scales.shape[1]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return kernels.int8_linear(x, layer.qweight, layer.scales, self._group(layer), bias, self.scratch,
                                   self.fixed_point)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """[out, in] float32: the weight apply multiplies by."""
        return kernels.int8_dequantize(layer.qweight, layer.scales, self._group(layer))
