"""The fused C++ layer ops equal the PyTorch reference (which the model-equivalence tests check against
transformers), on shapes of decode and prefill steps and on row-strided inputs, built for each instruction set
this CPU runs (KVSERVE_CPU_ISA; the CPU's best in the fast tier, the others `slow`). bfloat16:
tests/unit/test_bf16_kernels.py and tests/e2e/test_kernel_isa.py."""
from __future__ import annotations

import pytest
import torch

from kvserve.models.layer_ops import LayerOps, load_fused_layer_ops
from tests.helpers.kernels import LANES, isa_params


@pytest.fixture(scope="module", params=isa_params())
def fused(request):
    with pytest.MonkeyPatch.context() as m:
        m.setenv("KVSERVE_CPU_ISA", request.param)
        ops = load_fused_layer_ops()   # kvserve's own loader, which keeps one build per ISA
    if ops is None:
        pytest.skip("the C++ extension does not build here")
    assert ops.vector_width == LANES[request.param], "the build runs the vector code of its ISA"
    return ops


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm(fused, rows):
    torch.manual_seed(rows)
    x, res, w = torch.randn(rows, 96), torch.randn(rows, 96), torch.randn(96)
    want_x, want_res = LayerOps.add_rms_norm(x, res, w, 1e-5)
    got_x, got_res = fused.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)
    torch.testing.assert_close(got_x, want_x, rtol=1e-6, atol=1e-6)
    first_x, first_res = fused.add_rms_norm(x, None, w, 1e-5)  # first layer: no residual yet
    torch.testing.assert_close(first_x, LayerOps.add_rms_norm(x, None, w, 1e-5)[0])
    assert first_res is x


@pytest.mark.parametrize("rows", [1, 33])
def test_rope_on_leading_heads_of_fused_projection(fused, rows):
    torch.manual_seed(rows)
    heads, kv_heads, d = 4, 2, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d)
    angles = torch.randn(rows, d // 2).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    want = LayerOps.rope_qk(qkv, cos, sin, heads + kv_heads, d)
    got = fused.rope_qk(qkv.clone(), cos, sin, heads + kv_heads, d)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    v = (heads + kv_heads) * d
    assert torch.equal(got[:, v:], qkv[:, v:]), "v is not rotated"


def test_partial_rope_rotates_the_first_dims_of_each_head(fused):
    """cos/sin narrower than a head (partial RoPE): its first R dims rotate as a whole head of R would, the
    others and v pass through, in both implementations."""
    torch.manual_seed(3)
    heads, kv_heads, d, r = 4, 2, 16, 12
    qkv = torch.randn(9, (heads + 2 * kv_heads) * d)
    angles = torch.randn(9, r // 2).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    want = LayerOps.rope_qk(qkv, cos, sin, heads + kv_heads, d)
    got = fused.rope_qk(qkv.clone(), cos, sin, heads + kv_heads, d)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    by_head = qkv[:, :(heads + kv_heads) * d].reshape(9, heads + kv_heads, d)
    whole = LayerOps.rope_qk(by_head[..., :r].reshape(9, -1), cos, sin, heads + kv_heads, r)
    want_heads = want[:, :(heads + kv_heads) * d].reshape(9, heads + kv_heads, d)
    assert torch.equal(want_heads[..., :r], whole.reshape(9, heads + kv_heads, r))
    assert torch.equal(want_heads[..., r:], by_head[..., r:])
    assert torch.equal(got[:, (heads + kv_heads) * d:], qkv[:, (heads + kv_heads) * d:])


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_act_and_mul_on_a_row_strided_view(fused, op):
    torch.manual_seed(0)
    wide = torch.randn(5, 2 * 40 + 8) * 3
    gate_up = wide[:, :80]  # rows 88 apart: a view, as a split of a wider projection would be
    torch.testing.assert_close(getattr(fused, op)(gate_up), getattr(LayerOps, op)(gate_up), rtol=1e-6, atol=1e-6)


def test_bad_input_is_rejected(fused):
    with pytest.raises(RuntimeError, match="float32"):
        fused.silu_and_mul(torch.randn(3, 8, dtype=torch.float64))
