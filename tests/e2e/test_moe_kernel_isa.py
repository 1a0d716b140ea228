"""The fused MoE kernel (layers/csrc/moe.cpp) built for the instruction sets it has code for, on this machine:
AVX2 + FMA (-march=haswell, 8 lanes) and none (-march=x86-64-v2, scalar), each against the reference path in
float32, bfloat16 and int8 (per channel and groups of 32). The default build (-march=native: AVX-512 here) is
what tests/unit/test_moe.py runs. Skipped where this CPU cannot run the build."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvserve.layers.moe import experts_reference, select_experts
from kvserve.layers.moe_fused import quantize_experts

SOURCE = os.path.join(os.path.dirname(__file__), "..", "..", "kvserve", "layers", "csrc", "moe.cpp")


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


@pytest.mark.parametrize("march,lanes,needs", [("haswell", 8, {"avx2", "fma"}), ("x86-64-v2", 1, set())])
def test_each_instruction_set_equals_the_reference(march, lanes, needs, tmp_path):
    from torch.utils.cpp_extension import load

    if shutil.which("c++") is None or not needs <= _cpu_flags():
        pytest.skip(f"no compiler, or this CPU cannot run -march={march}")
    m = load(name=f"kvserve_moe_{march.replace('-', '_')}", sources=[SOURCE], build_directory=str(tmp_path),
             extra_cflags=["-O3", f"-march={march}", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"])
    assert m.vector_width() == lanes and m.fixed_tokens() == 0  # fixed-point inputs need AVX-512BW
    g, none = torch.Generator().manual_seed(0), torch.empty(0)
    for e, k, h, i, t in [(8, 2, 32, 24, 1), (8, 2, 40, 16, 17), (16, 4, 64, 48, 64), (10, 6, 64, 32, 5)]:
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
            torch.testing.assert_close(m.moe_experts(x, ids, weights, q13.q, q2.q, q13.scales, q2.scales, True),
                                       experts_reference(x, q13.dequantized(), q2.dequantized(), weights, ids),
                                       atol=1e-6, rtol=1e-5)
