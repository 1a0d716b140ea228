"""bfloat16 weights multiplied in float32: the linear method of a bfloat16 model on a CPU without native
bfloat16 (no AVX512_BF16 or AMX: utils/cpu_features.native_bf16()), chosen by linear_methods.default_method.

There PyTorch's bfloat16 matmul (oneDNN has no kernel for it) emulates bfloat16 arithmetic many times slower
than float32. This method keeps the loaded bfloat16 weight (half float32's bytes: a decode step streams half
as much) and runs kernels.bf16_linear: the weight widened to float32 in registers or per L2 panel, float32
products and sums, the result rounded to the activations' dtype: the numbers a native bfloat16 matmul with
float32 accumulation gives, up to summation order.
"""
from __future__ import annotations

import torch
from torch import nn

from kvserve.layers.quant import kernels


class Bf16WidenMethod:
    """Keeps `layer.weight` in bfloat16; apply widens it to float32 inside the matmul."""

    name = "bf16-fp32"

    def __init__(self):
        self.scratch = kernels.DenseScratch()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass  # NOTE: nothing to repack: the kernel reads the weight as loaded

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return kernels.bf16_linear(x, layer.weight, bias, self.scratch)
