"""The fast CPU path of the MoE experts (FusedMoE impl "fused"): one C++ call per layer (csrc/moe.cpp) that
buckets the (token, choice) pairs by expert and runs the active experts' gate/up, SiLU * up and down over all
cores, with float32, bfloat16 or int8 expert weights; and the int8 experts themselves.

int8 experts follow the dense linears' int8 method (layers/quant/int8.py, the same quantizer): each expert's
gate/up and down matrices get symmetric scales per group of input columns (or per output channel), computed
once at load from the full-precision weights, which are then freed.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch

from kvserve.config.quantization import PER_CHANNEL
from kvserve.layers.linear_methods import LinearMethod
from kvserve.layers.quant import kernels as quant_kernels
from kvserve.layers.quant.int8 import quantize_int8

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "moe.cpp")

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
"""Expert weight dtypes the C++ kernel reads (others, float16, take the sorted path)."""


@functools.lru_cache(maxsize=1)
def _module():
    from kvserve.utils.cpp_extension import build_extension

    return build_extension("kvserve_moe", _SOURCE, "fused MoE experts")


def available() -> bool:
    return _module() is not None


MAX_ROWS_PER_EXPERT = 64
"""Tokens x top_k / experts (an expert's rows, expected) from which the sorted path runs instead: the kernel's
multiply-adds are dot products over each weight row (its strength: few rows, the weights read once), where a
dense matmul (the sorted path's, one per active expert) has the blocked GEMM's reuse. `kvserve bench moe
--impls fused,sorted --batch-sizes ...` shows where the two cross."""

BF16_MAX_ROWS_PER_EXPERT = 16
"""The same for bfloat16 weights: the kernel widens them and multiply-adds in float32, while the sorted path's
bfloat16 matmul runs oneDNN's AVX512-BF16/AMX kernels, so it wins from fewer rows."""


def takes(x: torch.Tensor, w13: torch.Tensor, top_k: int) -> bool:
    """Whether the C++ kernel runs these experts: CPU tensors of a dtype it reads, few enough rows per expert
    (MAX_ROWS_PER_EXPERT), and it built here."""
    limit = BF16_MAX_ROWS_PER_EXPERT if w13.dtype == torch.bfloat16 else MAX_ROWS_PER_EXPERT
    return (x.is_cpu and w13.is_cpu and w13.dtype in KERNEL_DTYPES and x.shape[0] * top_k < limit * w13.shape[0]
            and available())


_NO_SCALES = torch.empty(0)


def experts_fused(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  s13: torch.Tensor | None = None, s2: torch.Tensor | None = None,
                  fixed_point: bool = False) -> torch.Tensor:
    """x [T, H], weights/ids [T, k] -> [T, H] in x's dtype (computed in float32). w13 [E, 2I, H], w2 [E, H, I]:
    float32 or bfloat16, or int8 codes with scales s13 [E, 2I, H / g], s2 [E, H, I / g]. `fixed_point`: int8
    experts at up to fixed_tokens() tokens round their inputs to 16-bit fixed point per 32 columns, as the dense
    int8 kernels do at one or two rows (layers/quant/kernels.py; FusedMoE passes envs.quant_fixed_point())."""
    out = _module().moe_experts(x.float().contiguous(), ids.contiguous(), weights.float().contiguous(),
                                w13, w2, _NO_SCALES if s13 is None else s13, _NO_SCALES if s2 is None else s2,
                                fixed_point)
    return out.to(x.dtype)


def fixed_tokens() -> int:
    """Tokens up to which the kernel can take int8 experts' inputs in fixed point (0: not this build or none)."""
    m = _module()
    return 0 if m is None else m.fixed_tokens()


@dataclasses.dataclass
class Int8Experts:
    """Stacked expert matrices [E, N, K] as int8 codes and float32 scales [E, N, K / group]."""

    q: torch.Tensor
    scales: torch.Tensor

    @property
    def group(self) -> int:
        return self.q.shape[-1] // self.scales.shape[-1]

    def dequantized(self) -> torch.Tensor:
        """[E, N, K] float32: the weights the int8 paths multiply by."""
        return self.q.float() * self.scales.repeat_interleave(self.group, dim=-1)

    def linear(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] -> [M, N] through expert e's matrix (the dense int8 linears' kernel). NOTE: without its
        fixed-point rounding of x, so that every expert path computes on the same dequantized weights."""
        return quant_kernels.int8_linear(rows, self.q[e], self.scales[e], self.group, None)


def quantize_experts(w: torch.Tensor, group_size: int) -> Int8Experts:
    """w [E, N, K] float -> its int8 codes and scales (layers/quant/int8.py's quantizer, expert by expert)."""
    e, n, k = w.shape
    q, scales = quantize_int8(w.reshape(e * n, k), group_size)
    return Int8Experts(q.reshape(e, n, k), scales.reshape(e, n, -1))


def int8_group(method: LinearMethod | None) -> int | None:
    """The int8 group size when the decoder layers' linear method (`method`, or the one a LoRA wrapper holds) is
    int8, so that the experts are quantized as the dense layers are; None otherwise (experts stay in the model
    dtype)."""
    base = getattr(method, "base", method)
    return base.group_size if getattr(base, "name", None) == "int8" else None


def check_int8_group(group_size: int, hidden_size: int, intermediate_size: int) -> None:
    """Refuse at construction a group that does not divide an expert matrix's input size (H for gate/up, this
    rank's I for down)."""
    if group_size == PER_CHANNEL:
        return
    for k in (hidden_size, intermediate_size):
        if k % group_size:
            raise ValueError(f"--quantization int8: group size {group_size} does not divide the expert input size "
                             f"{k} (hidden {hidden_size}, intermediate per rank {intermediate_size}); choose a "
                             "--quantization-group-size that divides both (or -1: one scale per output channel)")
