"""Attention backends by name (`--attention-backend`)."""
from __future__ import annotations

from kvserve.attention.backend import AttentionBackend
from kvserve.envs import triton_interpret

BACKENDS = ("auto", "cpu_paged", "torch_ref", "triton_paged")
_ALIASES = {"torch_sdpa": "torch_ref"}  # the reference backend's name before the two were split


def make_backend(name: str, device_type: str, quantized_kv: bool = False,
                 batch_invariant: bool = False) -> AttentionBackend:
    """auto: on CPU cpu_paged when its kernel builds, else torch_ref; on CUDA triton_paged when triton is
    installed and the KV cache is unquantized (its kernels read bf16/fp16/fp32 only), else torch_ref.
    `batch_invariant`: a backend whose per-row result does not depend on the step's other rows (cpu_paged's
    fixed order, triton_paged's fixed tiles); torch_ref has no such mode and is refused."""
    name = _ALIASES.get(name, name)
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    from kvserve.attention.torch_ref import TorchRefBackend

    if name == "torch_ref":
        if batch_invariant:
            raise ValueError("--batch-invariant needs attention backend cpu_paged (CPU) or triton_paged (CUDA): "
                             "torch_ref's SDPA reduces differently with the batch shape")
        return TorchRefBackend()
    if device_type == "cuda" and name in ("auto", "triton_paged"):
        backend = _triton_backend(name, quantized_kv, batch_invariant)
        if backend is None and batch_invariant:
            raise ValueError("--batch-invariant on CUDA needs the triton_paged backend: install triton "
                             "(pip install 'kvserve[gpu]') and keep --kv-cache-dtype auto")
        return backend or TorchRefBackend()
    if name == "triton_paged":
        if device_type == "cpu" and triton_interpret():  # tests: the GPU kernels through Triton's interpreter
            return _triton_backend(name, quantized_kv, batch_invariant)
        raise ValueError("attention backend triton_paged runs on CUDA only (or on the CPU through Triton's "
                         "interpreter, TRITON_INTERPRET=1: tests)")
    if device_type != "cpu":
        if name == "cpu_paged":
            raise ValueError("attention backend cpu_paged runs on the CPU only")
        if batch_invariant:
            raise ValueError(f"--batch-invariant is not supported on device {device_type!r}")
        return TorchRefBackend()
    from kvserve.attention.cpu_kernels import load_paged_attention
    from kvserve.attention.cpu_paged import CPUPagedBackend

    kernel = load_paged_attention()
    if kernel is None:
        if name == "cpu_paged" or batch_invariant:
            raise ValueError(f"{'--batch-invariant' if batch_invariant else 'attention backend cpu_paged'} needs "
                             "a C++ compiler and ninja to build the cpu_paged kernel")
        return TorchRefBackend()
    return CPUPagedBackend(kernel, fixed_order=batch_invariant)


def _triton_backend(name: str, quantized_kv: bool, batch_invariant: bool = False) -> AttentionBackend | None:
    from kvserve.attention.triton_paged import TritonPagedBackend, triton_available

    if quantized_kv:
        if name == "triton_paged":
            raise ValueError("attention backend triton_paged reads an unquantized KV cache only; use "
                             "--kv-cache-dtype auto or --attention-backend torch_ref")
        return None
    if not triton_available():
        if name == "triton_paged":
            raise ValueError("attention backend triton_paged needs triton: pip install 'kvserve[gpu]'")
        return None
    # NOTE: the flag is passed only when set, so the default path builds the backend exactly as before
    return TritonPagedBackend(batch_invariant=True) if batch_invariant else TritonPagedBackend()
