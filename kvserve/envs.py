"""Every environment variable kvserve reads, one function each.

Each function reads os.environ when called, never at import, so tests can monkeypatch the environment and a
long-lived process sees the value of the moment. An empty value counts as unset.
"""
from __future__ import annotations

import os


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def cache_dir() -> str:
    """Root of kvserve's on-disk caches (compiled kernels live under `kernels/`).

    `KVSERVE_CACHE_DIR` if set; else `$XDG_CACHE_HOME/kvserve`; else `~/.cache/kvserve`.
    """
    explicit = _get("KVSERVE_CACHE_DIR")
    if explicit is not None:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = _get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(xdg), "kvserve")


def api_keys() -> tuple[str, ...]:
    """KVSERVE_API_KEY: the API keys the server accepts when --api-key is not given (comma-separated)."""
    return tuple(k.strip() for k in (_get("KVSERVE_API_KEY") or "").split(",") if k.strip())


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 (Triton's own variable, read by triton when it is imported): Triton kernels run on
    CPU tensors through its interpreter, which lets --attention-backend triton_paged run on the CPU (tests)."""
    return _get("TRITON_INTERPRET") == "1"


def torchrun_rank() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) as torchrun sets them for each process it starts; None when either is unset
    (`--distributed-executor-backend external_launcher` needs both; MASTER_ADDR and MASTER_PORT are read
    by torch.distributed itself)."""
    rank, world = _get("RANK"), _get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    return int(rank), int(world)


def torchrun_local_rank() -> int:
    """LOCAL_RANK: the rank's index on its own host (its GPU there); 0 when unset."""
    return int(_get("LOCAL_RANK") or 0)


def quant_fixed_point() -> bool:
    """The int8/int4 kernels round one or two input rows to 16-bit fixed point and multiply-add as integers
    (layers/quant/kernels.py): on unless KVSERVE_QUANT_FIXED_POINT=0 (then exactly a float32 matmul on the
    dequantized weight, up to summation order)."""
    return _get("KVSERVE_QUANT_FIXED_POINT") != "0"


def keep_freed_memory() -> bool:
    """Freed host memory stays in the engine process for the next step (utils/host_malloc.py): on unless
    KVSERVE_KEEP_FREED_MEMORY=0 (glibc's own thresholds: large blocks go back to the OS on free)."""
    return _get("KVSERVE_KEEP_FREED_MEMORY") != "0"


def moe_impl() -> str:
    """KVSERVE_MOE_IMPL: how Mixture-of-Experts layers compute their experts (layers/moe.py): `fused` (the
    default: one C++ call per layer on the CPU, else as `sorted`), `sorted` (tokens sorted by expert, one pass
    over the active experts in PyTorch) or `reference` (transformers' loop)."""
    return _get("KVSERVE_MOE_IMPL") or "fused"


def cpu_isa() -> str | None:
    """KVSERVE_CPU_ISA: the instruction set the C++ kernels are built for, `avx512` | `avx2` | `scalar`
    (utils/cpu_isa.py); unset, the best this CPU runs. Forcing a lower one tests that path on a newer CPU, and
    makes kvserve choose as it would on such a CPU (no native bfloat16 below avx512: utils/cpu_features.py).

    It covers kvserve's own kernels only. PyTorch's kernels and oneDNN's (the dense matmuls) have their own
    caps, read when torch loads: ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA below. Emulating a whole machine of
    a lower class sets all three before the process starts (`cpu_isa.emulation_env`; `kvserve bench compare
    --cpu-isa` does it for every engine it starts; docs/features/cpu-kernels.md)."""
    return _get("KVSERVE_CPU_ISA")


def aten_cpu_capability() -> str | None:
    """ATEN_CPU_CAPABILITY (PyTorch's own: `default` | `avx2` | `avx512`, read when torch loads): the highest
    instruction set of PyTorch's CPU kernels. Read here only to report it."""
    return _get("ATEN_CPU_CAPABILITY")


def onednn_max_cpu_isa() -> str | None:
    """ONEDNN_MAX_CPU_ISA (oneDNN's own: `SSE41` | `AVX2` | `AVX512_CORE` | ... | `ALL`, read at oneDNN's first
    use): the highest instruction set of oneDNN's kernels, which run kvserve's dense matmuls on the CPU. Read
    here only to report it."""
    return _get("ONEDNN_MAX_CPU_ISA")


def batch_invariant() -> bool:
    """VLLM_BATCH_INVARIANT=1 (vLLM's spelling) or KVSERVE_BATCH_INVARIANT=1: as the --batch-invariant flag
    (docs/features/batch-invariance.md)."""
    return _get("VLLM_BATCH_INVARIANT") == "1" or _get("KVSERVE_BATCH_INVARIANT") == "1"
