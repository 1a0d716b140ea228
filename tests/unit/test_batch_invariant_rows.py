"""The row-wise steps --batch-invariant relies on without a kernel of its own (docs/features/batch-invariance.md):
the fused layer ops, PyTorch's RMSNorm (the first layer's), softmax and argmax (sampling) give every row the same
bits whatever the number of rows, in float32 and bfloat16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.layers.batch_invariant import check_rows
from kvserve.models.layer_ops import load_fused_layer_ops

HIDDEN = 2048


@pytest.fixture(scope="module")
def ops():
    fused = load_fused_layer_ops()
    if fused is None:
        pytest.skip("the fused layer ops do not build here")
    return fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_ops_are_row_invariant(ops, dtype):
    w = torch.randn(HIDDEN).to(dtype)

    def add_rms_norm(x):
        x, residual = x.clone(), (x * 0.5).contiguous()
        out, _ = ops.add_rms_norm(x, residual, w, 1e-5)
        return out

    def rope(x):
        positions = (x[:, 0].float().abs() * 100).long() % 17  # from the row itself: the same alone or batched
        angles = positions[:, None].float() * torch.linspace(0.01, 1.0, 32)[None, :]
        cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
        return ops.rope_qk(x.clone(), cos.to(dtype), sin.to(dtype), 16, 64)

    assert check_rows(add_rms_norm, HIDDEN, 40, dtype) == []
    assert check_rows(ops.silu_and_mul, HIDDEN, 40, dtype) == []
    assert check_rows(ops.gelu_tanh_and_mul, HIDDEN, 40, dtype) == []
    assert check_rows(rope, HIDDEN, 40, dtype) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_row_reductions_are_row_invariant(dtype):
    w = torch.randn(HIDDEN).to(dtype)
    assert check_rows(lambda x: F.rms_norm(x, (HIDDEN,), w, 1e-5), HIDDEN, 40, dtype) == []
    assert check_rows(lambda x: torch.softmax(x.float(), -1), 8192, 40, dtype) == []
    assert check_rows(lambda x: torch.log_softmax(x.float(), -1), 8192, 40, dtype) == []
    assert check_rows(lambda x: x.argmax(-1, keepdim=True), 8192, 40, dtype) == []
