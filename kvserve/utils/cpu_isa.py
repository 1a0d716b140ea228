"""Which instruction set the C++ kernels are built for: `selected_isa()` and the compiler flags of each.

Every kernel source has an AVX-512 path, an AVX2 + FMA path and a portable scalar one, chosen at compile time
by the compiler's own macros (`__AVX512F__`, `__AVX2__`). The build is picked at run time from what the CPU
reports, or forced with KVSERVE_CPU_ISA, so an AVX-512 machine can run (and CI can test) the AVX2 build. Each
variant is a different build in the kernel cache (its flags are part of the key: utils/cpp_extension.py).
"""
from __future__ import annotations

import functools
import platform

import kvserve.envs as envs

ISAS = ("avx512", "avx2", "scalar")
# NOTE: AVX-512 builds are -march=native so that they keep what this CPU adds (BF16, VNNI, FP16); the AVX2
# build names a fixed target (AVX2, FMA, F16C, BMI2) so that it defines no AVX-512 macro on an AVX-512 CPU.
_X86_FLAGS = {"avx512": ("-march=native",), "avx2": ("-march=haswell", "-mtune=native"),
              "scalar": ("-march=x86-64-v2", "-mtune=native")}
# PyTorch's and oneDNN's names for the same classes (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA). `avx512` caps
# neither: the kernels' avx512 build is -march=native too, with whatever AVX-512 extensions this CPU has.
_ATEN = {"avx512": "avx512", "avx2": "avx2", "scalar": "default"}
_ONEDNN = {"avx512": "ALL", "avx2": "AVX2", "scalar": "SSE41"}
# MKL's cap (its sgemv runs the float32 linears of one or two rows: layers/linear_methods.py); none at avx512
_MKL = {"avx2": "AVX2", "scalar": "SSE4_2"}
_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2": {"avx2", "fma", "f16c"},
          "scalar": set()}


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def supported_isas() -> tuple[str, ...]:
    """The variants this CPU can run, best first."""
    if not _x86():
        return ("scalar",)
    return tuple(isa for isa in ISAS if _NEEDS[isa] <= cpu_flags())


def detected_isa() -> str:
    return supported_isas()[0]


def selected_isa() -> str:
    """KVSERVE_CPU_ISA when set (checked: a variant this CPU cannot run is an error, not a crash later),
    else the best this CPU runs."""
    forced = envs.cpu_isa()
    if forced is None:
        return detected_isa()
    forced = forced.strip().lower()
    if forced not in ISAS:
        raise ValueError(f"KVSERVE_CPU_ISA={forced!r}: expected one of {', '.join(ISAS)}")
    if forced not in supported_isas():
        raise ValueError(f"KVSERVE_CPU_ISA={forced}: this CPU cannot run it (it runs {', '.join(supported_isas())})")
    return forced


def isa_cflags(isa: str) -> tuple[str, ...]:
    """The compiler flags that select `isa`'s code paths in every kernel source."""
    if not _x86():
        return ("-mcpu=native",) if platform.machine().lower() in ("aarch64", "arm64") else ()
    return _X86_FLAGS[isa]


def emulation_env(isa: str) -> dict[str, str]:
    """The environment that makes a process run as a CPU of `isa`'s class: kvserve's kernels (KVSERVE_CPU_ISA),
    PyTorch's (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA) and MKL's (MKL_ENABLE_INSTRUCTIONS, below
    avx512). The last three are read when torch loads, so they take effect in processes started with them, not
    in this one."""
    if isa not in ISAS:
        raise ValueError(f"unknown instruction set {isa!r}: expected one of {', '.join(ISAS)}")
    env = {"KVSERVE_CPU_ISA": isa, "ATEN_CPU_CAPABILITY": _ATEN[isa], "ONEDNN_MAX_CPU_ISA": _ONEDNN[isa]}
    if isa in _MKL:
        env["MKL_ENABLE_INSTRUCTIONS"] = _MKL[isa]
    return env
