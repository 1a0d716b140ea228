"""Every weight-only format's C++ kernel on every instruction set this CPU runs (AVX-512, AVX2 + FMA, scalar:
KVSERVE_CPU_ISA's builds, so an AVX-512 machine tests the AVX2 paths) against the PyTorch reference, at the
row counts that reach each kernel: fixed-point rows, the register passes, the panels, the tiles; and the
bfloat16-weight kernel (bf16 storage, float32 compute) against F.linear in float32."""
from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F

from kvserve.layers.linear_methods import OneDNNPackedMethod
from kvserve.layers.quant import kernels
from kvserve.layers.quant.bf16 import Bf16WidenMethod
from kvserve.layers.quant.gguf import GGUFMethod
from kvserve.layers.quant.int4 import Int4WeightOnlyMethod
from kvserve.layers.quant.int8 import Int8WeightOnlyMethod
from kvserve.model_loader.gguf_blocks import GGUFWeight
from kvserve.utils import cpu_isa
from tests.helpers.quant import linear_layer, quant_kernels_for

Q = gguf.GGMLQuantizationType
FORMATS = ["int8", "int8 g32", "int8 g128", "int4 g32", "int4 g128", "gguf Q4_0", "gguf Q4_1", "gguf Q8_0"]
# 1-2: fixed point (or float) rows; 3-5: a full and a partial AVX2 pass; 13: the register kernel's last sizes;
# 25: the panels (or the tiles from 48 rows); 130: the tiles or the dense path
ROWS = (1, 2, 3, 5, 13, 25, 48, 130)


@pytest.fixture(params=cpu_isa.ISAS)
def isa_kernels(request, monkeypatch):
    if request.param not in cpu_isa.supported_isas():
        pytest.skip(f"this CPU does not run {request.param}")
    module = quant_kernels_for(request.param, monkeypatch)
    if module is None:
        pytest.skip("the quantized-linear C++ extension does not build here")
    yield module
    kernels.tiles_fit.cache_clear()


def _method(name: str):
    if name.startswith("gguf"):
        return GGUFMethod(OneDNNPackedMethod()), Q[name.split()[1]]
    group = int(name.split("g")[-1]) if " g" in name else -1
    return (Int8WeightOnlyMethod(group) if name.startswith("int8") else Int4WeightOnlyMethod(group)), None


def _fixed_point(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel's fixed-point rows are: each run of 32 columns to int16 steps of max|run| / 32767."""
    runs = x.double().reshape(x.shape[0], -1, 32)
    step = runs.abs().amax(dim=-1, keepdim=True) / 32767
    return (torch.round(runs / step.clamp_min(1e-300)) * step).reshape(x.shape).float()


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("n", [160, 192])  # 192: whole tiles of 64 output rows; 160: the panels' partial one
def test_every_format_on_every_isa_equals_f_linear_on_its_dequantized_weight(name, n, isa_kernels, monkeypatch):
    assert isa_kernels.isa() == kernels.isa()
    torch.manual_seed(11)
    k = 384
    w, bias = torch.randn(n, k) * 0.05, torch.randn(n)
    outputs = {}
    for fixed in (False, True):
        monkeypatch.setenv("KVSERVE_QUANT_FIXED_POINT", "1" if fixed else "0")
        method, ggml_type = _method(name)
        loaded = None if ggml_type is None else GGUFWeight(gguf.quants.quantize(w.numpy(), ggml_type), ggml_type,
                                                           (n, k))
        layer = linear_layer(w, method, bias, loaded)
        deq = method.dequantized_weight(layer)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            x_used = _fixed_point(x) if fixed and rows <= kernels.fixed_point_rows() else x
            y = layer(x)
            torch.testing.assert_close(y, F.linear(x_used, deq, bias), rtol=1e-5, atol=3e-5,
                                       msg=lambda m, rows=rows, fixed=fixed: f"{kernels.isa()} rows={rows} fixed={fixed}: {m}")
            outputs[fixed, rows] = y
    # the fixed-point rows are a different computation only where the build has them
    assert torch.equal(outputs[False, 1], outputs[True, 1]) == (kernels.fixed_point_rows() == 0)


def test_each_isa_reports_its_kernels(isa_kernels):
    """What each build runs: register and fixed-point rows on AVX-512 and AVX2, tiles too; scalar: the panels."""
    simd = isa_kernels.isa() != "scalar"
    m = isa_kernels
    assert (m.small_rows() > 0, m.fixed_rows() > 0, m.tile_rows() > 0) == (simd, simd, simd)


@pytest.mark.parametrize("n, k", [(192, 384), (160, 96), (64, 40)])  # 40: not whole runs of 32 (PyTorch path)
def test_bf16_weights_multiply_in_float32(n, k, isa_kernels):
    """bf16 storage, float32 compute: y = x W^T in float32 with W's exact bf16 values, then rounded to x's dtype."""
    torch.manual_seed(12)
    w = (torch.randn(n, k) * 0.05).bfloat16()
    bias = torch.randn(n).bfloat16()
    layer = linear_layer(w.float(), Bf16WidenMethod(), bias.float())
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight, w)
    for rows in (1, 3, 13, 25, 130, kernels.BF16_WIDEN_DENSE_ROWS + 5):
        x = torch.randn(rows, k)
        ref = F.linear(x, w.float(), bias.float())
        torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
        got = layer(x.bfloat16().reshape(rows, 1, k))
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 1, n)
        # one rounding of the float32 result to bf16 (half a bf16 step), nothing accumulated in bf16
        torch.testing.assert_close(got[:, 0].float(), F.linear(x.bfloat16().float(), w.float(), bias.float()),
                                   rtol=2 ** -8, atol=1e-6)
