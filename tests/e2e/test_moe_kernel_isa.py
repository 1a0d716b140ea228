"""The fused MoE kernel (layers/csrc/moe.cpp) built for each instruction set it has code for that this machine
runs, through the kernels' own build path (KVSERVE_CPU_ISA, utils/cpp_extension.build_extension: each variant
its own cached build): AVX-512, AVX2 + FMA and scalar, each against the reference path in float32, bfloat16 and
int8 (per channel and groups of 32), at token counts where experts see one, a few and many tokens (the kernel's
passes over tokens per weight row) and at shapes off the vector width."""
from __future__ import annotations

import os

import pytest
import torch

from kvserve.layers.moe import experts_reference, select_experts
from kvserve.layers.moe_fused import quantize_experts
from kvserve.utils.cpp_extension import build_extension
from kvserve.utils.cpu_isa import supported_isas

SOURCE = os.path.join(os.path.dirname(__file__), "..", "..", "kvserve", "layers", "csrc", "moe.cpp")
LANES = {"avx512": 16, "avx2": 8, "scalar": 1}


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_each_instruction_set_equals_the_reference(isa, monkeypatch):
    if isa not in supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    monkeypatch.setenv("KVSERVE_CPU_ISA", isa)
    m = build_extension("kvserve_moe", SOURCE, f"fused MoE experts ({isa})")
    if m is None:
        pytest.skip("no compiler here")
    assert m.vector_width() == LANES[isa]
    assert (m.fixed_tokens() > 0) == (isa == "avx512")  # fixed-point inputs need AVX-512BW
    g, none = torch.Generator().manual_seed(0), torch.empty(0)
    for e, k, h, i, t in [(8, 2, 32, 24, 1), (8, 2, 40, 16, 17), (16, 4, 64, 48, 64), (10, 6, 64, 32, 5),
                          (4, 2, 64, 32, 150)]:
        w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
        x = torch.randn(t, h, generator=g)
        weights, ids = select_experts(torch.randn(t, e, generator=g), k, True)
        want = experts_reference(x, w13, w2, weights, ids)
        got = m.moe_experts(x, ids, weights, w13, w2, none, none, False)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        b13, b2 = w13.bfloat16(), w2.bfloat16()
        torch.testing.assert_close(m.moe_experts(x, ids, weights, b13, b2, none, none, False),
                                   experts_reference(x, b13.float(), b2.float(), weights, ids), atol=1e-6, rtol=1e-5)
        for group in (-1, 32) if h % 32 == 0 and i % 32 == 0 else (-1,):
            q13, q2 = quantize_experts(w13, group), quantize_experts(w2, group)
            torch.testing.assert_close(m.moe_experts(x, ids, weights, q13.q, q2.q, q13.scales, q2.scales, False),
                                       experts_reference(x, q13.dequantized(), q2.dequantized(), weights, ids),
                                       atol=1e-6, rtol=1e-5)
