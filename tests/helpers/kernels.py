"""The C++ kernels built for each instruction set this CPU runs (KVSERVE_CPU_ISA: utils/cpu_isa.py), each build
loaded once per test session. kvserve's own loaders keep the build of the ISA selected when they are first
called; tests that run several variants in one process load them here, by ISA."""
from __future__ import annotations

import functools

import pytest

from kvserve.attention import cpu_kernels
from kvserve.layers import batch_invariant, moe_fused
from kvserve.layers.quant import kernels as quant_kernels
from kvserve.models import layer_ops
from kvserve.utils.cpp_extension import build_extension
from kvserve.utils.cpu_isa import detected_isa, supported_isas

# kernel -> (the build's name, as its loader names it; its source; what the logs call it)
KERNELS = {
    "paged_attention": ("kvserve_paged_attention", cpu_kernels._SOURCE, "paged attention"),
    "quant_linear": ("kvserve_quant_linear", quant_kernels._SOURCE, "weight-only quantized linear"),
    "layer_ops": ("kvserve_layer_ops", layer_ops._SOURCE, "fused layer ops"),
    "moe": ("kvserve_moe", moe_fused._SOURCE, "fused MoE experts"),
    "batch_invariant": ("kvserve_batch_invariant", batch_invariant._SOURCE, "batch-invariant matmul"),
}

LANES = {"avx512": 16, "avx2": 8, "scalar": 1}
"""float32 lanes of each variant's vector code (a kernel's `vector_width()`, where it has one)."""


def isa_params() -> list:
    """Each ISA this CPU runs, as pytest params; all but the CPU's best are `slow`: a first build takes about a
    minute, and the best one is what every fast kernel test loads already."""
    return [pytest.param(isa, id=isa, marks=() if isa == detected_isa() else pytest.mark.slow)
            for isa in supported_isas()]


@functools.cache
def build_for(kernel: str, isa: str):
    """`kernel`'s module built for `isa` (from the kernel cache when built before), or None where it cannot be
    built here."""
    name, source, what = KERNELS[kernel]
    with pytest.MonkeyPatch.context() as m:
        m.setenv("KVSERVE_CPU_ISA", isa)
        return build_extension(name, source, what)


def build_or_skip(kernel: str, isa: str):
    module = build_for(kernel, isa)
    if module is None:
        pytest.skip(f"the {kernel} extension does not build here for {isa}")
    return module
