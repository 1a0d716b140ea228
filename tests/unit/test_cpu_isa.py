"""KVSERVE_CPU_ISA picks the kernels' instruction set: checked against what the CPU runs, and each variant is a
build of its own (its flags are in the cache key)."""
from __future__ import annotations

import pytest

from kvserve.utils import cpp_extension, cpu_isa


def test_detected_is_the_best_supported_and_scalar_always_runs():
    supported = cpu_isa.supported_isas()
    assert supported[-1] == "scalar" and cpu_isa.detected_isa() == supported[0]
    assert list(supported) == [isa for isa in cpu_isa.ISAS if isa in supported]  # best first


def test_forced_isa_is_validated(monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_ISA", "scalar")
    assert cpu_isa.selected_isa() == "scalar"
    if "avx2" in cpu_isa.supported_isas():
        monkeypatch.setenv("KVSERVE_CPU_ISA", " AVX2 ")
        assert cpu_isa.selected_isa() == "avx2"
    monkeypatch.setenv("KVSERVE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="KVSERVE_CPU_ISA='sse9': expected one of avx512, avx2, scalar"):
        cpu_isa.selected_isa()
    monkeypatch.setenv("KVSERVE_CPU_ISA", "")
    assert cpu_isa.selected_isa() == cpu_isa.detected_isa()


def test_a_variant_the_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_isa, "_x86", lambda: True)
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"sse4_2", "avx2", "fma", "f16c"}))
    assert cpu_isa.supported_isas() == ("avx2", "scalar")
    monkeypatch.setenv("KVSERVE_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="cannot run it"):
        cpu_isa.selected_isa()


def test_each_variant_is_its_own_build():
    code = b"// a kernel\n"
    names = {isa: cpp_extension.kernel_module_name("k", code, isa) for isa in cpu_isa.ISAS}
    assert len(set(names.values())) == 3 and all(names[isa].startswith(f"k_{isa}_") for isa in cpu_isa.ISAS)
    if cpu_isa._x86():
        assert "-march=haswell" in cpp_extension.build_cflags("avx2")
        assert "-march=native" not in cpp_extension.build_cflags("avx2")
