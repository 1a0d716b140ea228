"""BatchInvariantMethod: the linear method of `--batch-invariant`, whose result for a row does not depend on how
many other rows are multiplied with it (docs/features/batch-invariance.md).

On the CPU it runs csrc/batch_invariant.cpp: each output element reduced over K in one fixed order, whatever the
tile shape or thread. F.linear (MKL) and oneDNN's packed matmul are not row-invariant: they change kernels and
K blocking with the number of rows (`python -m kvserve.layers.batch_invariant` shows it). On CUDA it calls the
fixed-tile Triton matmul, kvserve.layers.triton_batch_invariant.linear.
"""
from __future__ import annotations

import functools
import os

import torch
from torch import nn

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "batch_invariant.cpp")


def load_kernel():
    """The compiled kernel for the selected instruction set (KVSERVE_CPU_ISA or the CPU's best), or None
    (logged) when it cannot be built here."""
    from kvserve.utils.cpu_isa import selected_isa

    return _load(selected_isa())


@functools.cache
def _load(isa: str):
    # NOTE: keyed by the ISA, so a process that changes KVSERVE_CPU_ISA (a test) gets that build
    from kvserve.utils.cpp_extension import build_extension

    return build_extension("kvserve_batch_invariant", _SOURCE, "batch-invariant matmul")


class BatchInvariantMethod:
    """y = x W^T + b with every output element summed over the inputs in one order (float32 sums; bfloat16
    weights widened, the result rounded once to the activations' dtype). `kernel`: load_kernel()'s module, or
    None on CUDA."""

    name = "batch-invariant"

    def __init__(self, kernel=None):
        self.kernel = kernel

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.detach()
        if weight.device.type == "cpu":
            # NOTE: a packed copy beside the loaded weight (kept, as OneDNNPackedMethod keeps it), float32
            # unless the model is bfloat16
            packed = weight if weight.dtype in (torch.float32, torch.bfloat16) else weight.float()
            layer.invariant_weight = self.kernel.pack(packed)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n = layer.weight.shape[0]
        if x.device.type == "cuda":
            from kvserve.layers.triton_batch_invariant import linear
            return linear(x.reshape(-1, x.shape[-1]), layer.weight, bias).view(*x.shape[:-1], n)
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()                        # [M, K]
        out = self.kernel.linear(rows, layer.invariant_weight, n, None if bias is None else bias.float())
        return out.view(*x.shape[:-1], n).to(x.dtype)


def check_rows(fn, k: int, max_rows: int, dtype: torch.dtype = torch.float32) -> list[int]:
    """The row counts M in 2..max_rows at which some row of fn(x[:M]) differs in any bit from fn of that row
    alone (fn: [M, k] -> [M, n])."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max_rows, k, generator=gen).to(dtype)
    alone = torch.cat([fn(x[i:i + 1]) for i in range(max_rows)])
    return [m for m in range(2, max_rows + 1) if not torch.equal(fn(x[:m]), alone[:m])]


if __name__ == "__main__":  # which matmuls keep a row's bits whatever M is (docs/features/batch-invariance.md)
    import torch.nn.functional as F

    from kvserve.layers.linear_methods import OneDNNPackedMethod

    for dtype in (torch.float32, torch.bfloat16):
        for n, k in ((960, 576), (576, 1536)):  # SmolLM2's qkv and down projections
            layer = nn.Module()
            layer.weight = nn.Parameter((torch.randn(n, k) * 0.02).to(dtype), requires_grad=False)
            methods = {"F.linear": None, "onednn": OneDNNPackedMethod(), "batch-invariant":
                       BatchInvariantMethod(load_kernel())}
            for name, method in methods.items():
                if method is not None:
                    method.process_weights_after_loading(layer)
                fn = (lambda x: F.linear(x, layer.weight)) if method is None else (
                    lambda x, method=method: method.apply(layer, x, None))
                bad = check_rows(fn, k, 64, dtype)
                print(f"{str(dtype).removeprefix('torch.'):8s} [{n}, {k}] {name:16s} rows differ at "
                      f"{len(bad)} of 63 batch sizes{': M = ' + ', '.join(map(str, bad[:6])) if bad else ''}",
                      flush=True)
