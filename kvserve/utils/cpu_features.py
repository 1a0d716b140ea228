"""Does this CPU multiply bfloat16 natively (AVX512_BF16 or AMX-BF16)? It decides what `--dtype auto` picks on
the CPU and which matmul a bf16 model gets; without it oneDNN has no bf16 kernel and PyTorch's own bf16 matmul
runs under 1 GFLOP/s."""
from __future__ import annotations

import functools

_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    import torch

    from kvserve.utils.cpu_isa import selected_isa

    if selected_isa() != "avx512":  # KVSERVE_CPU_ISA=avx2|scalar stands for a CPU without AVX-512, so without these
        return False

    # NOTE: torch.backends.cpu.get_cpu_capability() says "AVX512" with or without the bf16 extension, so it
    # cannot tell; torch.cpu's private probes can, and /proc/cpuinfo where they are missing.
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(probe is not None for probe in probes):
        return any(probe() for probe in probes)
    return bool(_cpuinfo_bf16_flags())


def _cpuinfo_bf16_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split()) & set(_BF16_FLAGS)
