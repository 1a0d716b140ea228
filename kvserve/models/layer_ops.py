"""The decoder layer's element-wise steps: add + RMSNorm, RoPE on q and k, SiLU-and-mul (GELU-and-mul: Gemma).

`LayerOps` is the PyTorch reference; `FusedLayerOps` does each step in one C++ call (csrc/layer_ops.cpp),
in place where the reference allocates. On CPU a decode step's element-wise work is small and PyTorch's
per-call dispatch dominates it: the fused ops cut a layer from ~45 PyTorch calls to ~20. Tests compare the
two; the engine picks the fused ones on CPU float32 and bfloat16 when the extension builds.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "layer_ops.cpp")


class LayerOps:
    name = "torch"

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual) * weight, x + residual); with no residual yet, x itself is the residual."""
        residual = x if residual is None else x + residual
        return F.rms_norm(residual, (residual.shape[-1],), weight, eps), residual

    @staticmethod
    def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                head_dim: int) -> torch.Tensor:
        """qkv [T, W] with RoPE applied to its first num_heads heads (q then k); cos/sin [T, R]: the first R dims
        of each head rotate (R < head_dim: partial RoPE, transformers' Phi-3; the other dims pass through)."""
        t, r = qkv.shape[0], cos.shape[-1]
        rot = qkv[:, :num_heads * head_dim].view(t, num_heads, head_dim)
        if r != head_dim:
            rot, kept = rot[..., :r], rot[..., r:]
        half = r // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
        if r != head_dim:
            out = torch.cat((out, kept), dim=-1)
        return torch.cat((out.reshape(t, -1), qkv[:, num_heads * head_dim:]), dim=-1)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """Gemma's MLP gating: GELU with the tanh approximation (transformers' gelu_pytorch_tanh)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class TritonInvariantLayerOps(LayerOps):
    """`--batch-invariant` on CUDA: add + RMSNorm by layers/triton_batch_invariant.py, one program per row, so a
    row's norm does not depend on how many rows the step has (PyTorch's reduction kernel picks its split by
    shape); RoPE and the gated activations are element-wise and stay PyTorch's."""

    name = "triton-invariant"

    @staticmethod
    def add_rms_norm(x, residual, weight, eps):
        from kvserve.layers.triton_batch_invariant import add_rms_norm

        return add_rms_norm(x, residual, weight, eps)


class FusedLayerOps(LayerOps):
    name = "fused"

    def __init__(self, module):
        self._m = module

    def add_rms_norm(self, x, residual, weight, eps):
        if residual is None:  # first layer: nothing to add yet
            return F.rms_norm(x, (x.shape[-1],), weight, eps), x
        self._m.add_rms_norm_(x, residual, weight, eps)  # x becomes the norm, residual the sum
        return x, residual

    def rope_qk(self, qkv, cos, sin, num_heads, head_dim):
        self._m.rope_(qkv, cos, sin, num_heads, head_dim)
        return qkv

    def silu_and_mul(self, gate_up):
        return self._m.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up):
        return self._m.gelu_tanh_and_mul(gate_up)

    @property
    def vector_width(self) -> int:
        """float32 lanes of the build's vector code: 16 (AVX-512), 8 (AVX2 + FMA) or 1 (scalar)."""
        return self._m.vector_width()


def load_fused_layer_ops() -> FusedLayerOps | None:
    """The fused ops built for the selected instruction set (KVSERVE_CPU_ISA or the CPU's best:
    utils/cpu_isa.py), or None (logged) when the extension cannot be built here."""
    from kvserve.utils.cpu_isa import selected_isa

    return _load(selected_isa())


@functools.cache
def _load(isa: str) -> FusedLayerOps | None:
    # NOTE: keyed by the ISA, so a process that changes KVSERVE_CPU_ISA (a test) gets that build, not the first
    from kvserve.utils.cpp_extension import build_extension

    module = build_extension("kvserve_layer_ops", _SOURCE, "fused layer ops")
    return FusedLayerOps(module) if module is not None else None
