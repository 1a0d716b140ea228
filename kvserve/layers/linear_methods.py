"""How a linear layer multiplies: a method object the layer delegates to (vLLM's LinearMethodBase).

The layer owns its parameters and loads them; the method may add what it needs (a packed copy, scales)
once loading is done, and computes y = x W^T + b. Quantized methods (int8/int4) and the LoRA wrapper plug
in here; the model file never changes.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(Protocol):
    name: str

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every weight of `layer` is loaded (repack, quantize, ...)."""
        ...

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out] with `layer.weight` [out, in]."""
        ...


class DenseMethod:
    """F.linear on the weight as loaded (any device and dtype)."""

    name = "dense"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class OneDNNPackedMethod:
    """CPU fp32 and bf16: the weight reordered once into oneDNN's blocked layout (kept beside the loaded weight,
    which stays for inspection and reloading). fp32: faster than F.linear's MKL sgemm at every batch size we
    run, most at decode sizes. bf16 (AVX512_BF16/AMX dot products, fp32 accumulation): faster than F.linear on
    the bf16 weight at decode sizes, level with it at prefill sizes.
    `python -m kvserve.layers.linear_methods` prints the comparison. Results differ from F.linear only by
    summation order (~1e-6 relative in fp32).

    Except float32 at up to GEMV_ROWS rows (a single-stream decode step, or two): there F.linear on the loaded
    weight (MKL's sgemv) streams a whole model's weights from memory faster than oneDNN's packed path, measured
    over every linear of the built-in model, which does not fit in the last-level cache (`python -m
    kvserve.bench.streaming --linear-paths`); one copy of a layer, which does fit, flatters the packed path."""

    name = "onednn"
    GEMV_ROWS = 2

    @staticmethod
    def available() -> bool:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= self.GEMV_ROWS and x.dim() == 2 and layer.weight.dtype == torch.float32:
            return F.linear(x, layer.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")


def default_method(device: torch.device, dtype: torch.dtype) -> LinearMethod:
    """The fastest method that is exact for this device and dtype. bf16 on a CPU without native bf16 keeps its
    weights in bf16 and multiplies them in fp32 (layers/quant/bf16.py): PyTorch's bf16 matmul there is emulated."""
    from kvserve.utils import cpu_features

    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_features.native_bf16():
        from kvserve.layers.quant.bf16 import Bf16WidenMethod
        return Bf16WidenMethod()
    if device.type != "cpu" or not OneDNNPackedMethod.available():
        return DenseMethod()
    if dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_features.native_bf16()):
        return OneDNNPackedMethod()
    return DenseMethod()


def packed_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed path at any number of rows (what apply runs above GEMV_ROWS)."""
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")


if __name__ == "__main__":  # the per-layer measurement behind OneDNNPackedMethod's docstring
    import time

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2: qkv, o, gate_up, down
    # NOTE: 8 copies of the layer, used in turn, so that (as in a 30-layer model's decode) weights come from
    # DRAM rather than the last-level cache; one copy fits in it and flatters small batches.
    copies = 8
    for m, dtype in ((m, dtype) for dtype in (torch.float32, torch.bfloat16) for m in (1, 16, 64, 512)):
        xs = [torch.randn(m, k, dtype=dtype) for _, k in shapes]
        stacks = []
        for _ in range(copies):
            layers = []
            for n, k in shapes:
                layer = nn.Module()
                layer.weight = nn.Parameter((torch.randn(n, k) * 0.02).to(dtype), requires_grad=False)
                layer.bias = None
                layers.append(layer)
            stacks.append(layers)
        flops = sum(2 * m * n * k for n, k in shapes)
        for name in ("dense", "onednn"):
            for layers in stacks:
                for layer in layers:
                    OneDNNPackedMethod().process_weights_after_loading(layer)

            def one_pass(stacks=stacks, xs=xs, name=name):
                for layers in stacks:
                    [F.linear(x, la.weight) if name == "dense" else packed_linear(la, x) for la, x in zip(layers, xs)]

            with torch.inference_mode():
                one_pass()
                reps = max(2, 240 // m)
                t = time.perf_counter()
                for _ in range(reps):
                    one_pass()
                dt = (time.perf_counter() - t) / reps / copies
            print(f"{str(dtype).removeprefix('torch.'):8s} M={m:4d} {name:7s} {dt * 1e3:7.3f} ms per layer  "
                  f"{flops / dt / 1e9:6.1f} GFLOP/s", flush=True)
