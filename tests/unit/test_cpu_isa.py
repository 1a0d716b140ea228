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


def test_native_bf16_follows_the_selected_isa(monkeypatch):
    """Forcing a lower ISA emulates its CPU class in kvserve's choices too: no native bf16 below avx512."""
    from kvserve.utils import cpu_features

    monkeypatch.setattr(cpu_features, "_cpu_bf16", lambda: True)
    for isa in ("avx2", "scalar"):
        if isa in cpu_isa.supported_isas():
            monkeypatch.setenv("KVSERVE_CPU_ISA", isa)
            assert not cpu_features.native_bf16()
    monkeypatch.delenv("KVSERVE_CPU_ISA")
    assert cpu_features.native_bf16() == (cpu_isa.detected_isa() == "avx512")
    monkeypatch.setattr(cpu_features, "_cpu_bf16", lambda: False)
    assert not cpu_features.native_bf16()


def test_emulation_env_caps_every_kernel_library():
    assert cpu_isa.emulation_env("avx2") == {"KVSERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                                             "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert cpu_isa.emulation_env("scalar") == {"KVSERVE_CPU_ISA": "scalar", "ATEN_CPU_CAPABILITY": "default",
                                               "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
    assert cpu_isa.emulation_env("avx512")["ONEDNN_MAX_CPU_ISA"] == "ALL"
    with pytest.raises(ValueError, match="unknown instruction set 'neon'"):
        cpu_isa.emulation_env("neon")


def test_isa_line_says_what_ran_and_whether_it_was_forced():
    from kvserve.utils.cpu_features import describe_isa, isa_info

    info = {"kernels": "avx2", "detected": "avx512", "aten": "AVX2", "onednn_max": "AVX2", "native_bf16": False}
    assert describe_isa(info) == ("kernels avx2 (forced; this CPU runs avx512), PyTorch AVX2, oneDNN max AVX2, "
                                  "native bf16 no")
    assert describe_isa(info | {"kernels": "avx512", "native_bf16": True}).startswith("kernels avx512, PyTorch")
    assert isa_info()["kernels"] == cpu_isa.selected_isa()
