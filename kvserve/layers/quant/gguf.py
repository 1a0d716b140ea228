"""`--quantization gguf`: a GGUF file's Q4_0 / Q4_1 / Q8_0 linear weights kept in their blocks' precision.

The loader yields such weights as GGUFWeight (model_loader/gguf_blocks.py) instead of dequantizing them; the layer records
each part where it belongs (fused q/k/v, gate/up rows: `LinearBase.checkpoint_parts`), and this method
repacks them once loading is done: Q4_0/Q4_1 onto the int4 kernel, Q8_0 onto the int8 kernel, both group 32
with the file's own scales and mins (no requantization). A layer whose parts are not all of one kernel's
types (another GGUF type such as F16 or Q6_K, dequantized by the loader, or Q8_0 beside Q4) is dequantized
into its dense weight and runs the base method.
"""
from __future__ import annotations

import torch
from torch import nn

import kvserve.envs as envs
from kvserve.layers.linear_methods import LinearMethod
from kvserve.layers.quant import kernels
from kvserve.layers.quant.common import drop_dense_weight
from kvserve.model_loader.gguf_blocks import Q4_TYPES, Q8_TYPES, QK, q4_blocks, q8_0_blocks


class GGUFMethod:
    name = "gguf"

    def __init__(self, dense: LinearMethod):
        self.dense = dense
        self.scratch = kernels.DenseScratch()
        self.fixed_point = envs.quant_fixed_point()
        """The method of layers whose parts are not all kept blocks (see the module docstring)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = sorted(layer.checkpoint_parts, key=lambda part: part[0])      # (first row, GGUFWeight)
        layer.checkpoint_parts = []
        types = {weight.ggml_type for _, weight in parts}
        whole = sum(weight.shape[0] for _, weight in parts) == layer.output_size
        if whole and types <= set(Q4_TYPES):
            qs, scales, mins = zip(*(q4_blocks(weight) for _, weight in parts))
            layer.qweight = torch.cat(qs).to(layer.weight.device)            # [out, in / 2] uint8
            layer.scales = torch.cat(scales).to(layer.weight.device)         # [out, in / 32]
            layer.mins = torch.cat(mins).to(layer.weight.device)             # [out, in / 32]
            layer.quant_format = "int4"
        elif whole and types <= set(Q8_TYPES):
            qs, scales = zip(*(q8_0_blocks(weight) for _, weight in parts))
            layer.qweight = torch.cat(qs).to(layer.weight.device)            # [out, in] int8
            layer.scales = torch.cat(scales).to(layer.weight.device)         # [out, in / 32]
            layer.quant_format = "int8"
        else:
            for start, weight in parts:
                layer.weight.data.narrow(0, start, weight.shape[0]).copy_(weight.dequantize())
            layer.quant_format = "dense"
            self.dense.process_weights_after_loading(layer)
            return
        drop_dense_weight(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.quant_format == "int4":
            return kernels.int4_linear(x, layer.qweight, layer.scales, layer.mins, QK, bias, self.scratch,
                                       self.fixed_point)
        if layer.quant_format == "int8":
            return kernels.int8_linear(x, layer.qweight, layer.scales, QK, bias, self.scratch, self.fixed_point)
        return self.dense.apply(layer, x, bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """[out, in] float32: the weight apply multiplies by."""
        if layer.quant_format == "int4":
            return kernels.int4_dequantize(layer.qweight, layer.scales, layer.mins, QK)
        if layer.quant_format == "int8":
            return kernels.int8_dequantize(layer.qweight, layer.scales, QK)
        return layer.weight.detach().float()
