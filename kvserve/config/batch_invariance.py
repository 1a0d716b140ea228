"""What `--batch-invariant` cannot make invariant, refused at start-up with a reason (docs/features/batch-invariance.md).

Invariant: fp32 and bf16 dense weights (layers/batch_invariant.py), the cpu_paged and triton_paged attention
backends in their fixed-order modes, the fused per-row layer ops, and sampling (per-request generators).
Refused: anything whose kernel reduces in an order that depends on the batch or on other ranks.
"""
from __future__ import annotations

from kvserve.model_loader.architectures import resolve_architecture


def refusal(*, quantization: str | None, kv_cache_dtype: str, tensor_parallel_size: int, enable_lora: bool,
            attention_backend: str) -> str | None:
    """Why the flags, with --batch-invariant, cannot be served invariantly; None: they can."""
    if quantization is not None:
        return (f"--quantization {quantization}: the weight-only kernels sum in blocks that depend on the number "
                "of rows; serve the float32 or bfloat16 weights")
    if kv_cache_dtype != "auto":
        return (f"--kv-cache-dtype {kv_cache_dtype}: a block's scale depends on which tokens were written to it "
                "together (how the prompt was chunked); use --kv-cache-dtype auto")
    if tensor_parallel_size > 1:
        return "--tensor-parallel-size > 1: the all-reduce's summation order is not fixed; use one rank"
    if enable_lora:
        return "--enable-lora: the batched LoRA kernels are not row-invariant yet"
    if attention_backend in ("torch_ref", "torch_sdpa"):
        return ("--attention-backend torch_ref: SDPA reduces differently with the batch shape; use auto, "
                "cpu_paged (CPU) or triton_paged (CUDA)")
    return None


def model_refusal(hf_config) -> str | None:
    """Why this architecture cannot run invariantly; None: it can."""
    name, feats = resolve_architecture(hf_config)
    if feats.moe:
        return f"{name}: the MoE experts' kernel groups tokens by expert across the batch"
    if feats.mla:
        return f"{name}: MLA attention runs in PyTorch, whose reductions change with the batch shape"
    return None
