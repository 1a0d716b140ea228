"""Does this CPU multiply bfloat16 natively (AVX512_BF16 or AMX-BF16)? It decides what `--dtype auto` picks on
the CPU and which matmul a bf16 model gets; without it oneDNN has no bf16 kernel and PyTorch's own bf16 matmul
runs under 1 GFLOP/s.

The answer follows the selected instruction set (utils/cpu_isa.py): with KVSERVE_CPU_ISA=avx2 or scalar it is
no, whatever the CPU has, so that forcing a lower ISA emulates a CPU of that class in the engine's choices too
(a whole-machine emulation also caps oneDNN and ATen: docs/features/cpu-kernels.md)."""
from __future__ import annotations

import functools

import kvserve.envs as envs
from kvserve.utils.cpu_isa import cpu_flags, detected_isa, selected_isa

_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def native_bf16() -> bool:
    """AVX512_BF16 or AMX-BF16 on this CPU, and the selected ISA is avx512 (KVSERVE_CPU_ISA unset or avx512)."""
    return selected_isa() == "avx512" and _cpu_bf16()


@functools.lru_cache(maxsize=1)
def _cpu_bf16() -> bool:
    import torch

    # NOTE: torch.backends.cpu.get_cpu_capability() says "AVX512" with or without the bf16 extension, so it
    # cannot tell; torch.cpu's private probes can, and /proc/cpuinfo where they are missing.
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(probe is not None for probe in probes):
        return any(probe() for probe in probes)
    return bool(cpu_flags() & set(_BF16_FLAGS))


def isa_info() -> dict:
    """Which instruction sets this process runs: kvserve's kernels (`kernels`, and `detected`, the CPU's best),
    PyTorch's (`aten`, as torch reports it), oneDNN's cap (`onednn_max`: ALL when unset), and whether bfloat16
    matmuls count as native (`native_bf16`)."""
    import torch

    return {"kernels": selected_isa(), "detected": detected_isa(),
            "aten": torch.backends.cpu.get_cpu_capability(), "onednn_max": envs.onednn_max_cpu_isa() or "ALL",
            "native_bf16": native_bf16()}


def describe_isa(info: dict | None = None) -> str:
    """`isa_info()` (or a given one: another process's) as one line for logs and report headers."""
    i = info or isa_info()
    forced = "" if i["kernels"] == i["detected"] else f" (forced; this CPU runs {i['detected']})"
    return (f"kernels {i['kernels']}{forced}, PyTorch {i['aten']}, oneDNN max {i['onednn_max']}, "
            f"native bf16 {'yes' if i['native_bf16'] else 'no'}")
