"""ModelConfig: which checkpoint, its Hugging Face config, the dtype it runs in and its longest sequence."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.sample.sampler import DEFAULT_LOGPROBS_MODE

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    source: Any
    """model_loader.loader.ModelSource: a Hugging Face folder or a GGUF file."""
    hf_config: Any
    """The checkpoint's transformers config, with num_key_value_heads and head_dim filled in."""
    architecture: str
    """A key of model_loader.architectures.ARCHITECTURES."""
    dtype: torch.dtype
    """Weights, activations and KV cache."""
    max_model_len: int
    """Longest prompt + output, in tokens."""
    max_logprobs: int
    """Largest `logprobs` a request may ask for."""
    served_name: str
    """The name outputs and the server report for this model."""
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE
    """What sampled tokens' logprobs report (sample/sampler.py: LOGPROBS_MODES)."""

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @classmethod
    def resolve(cls, model: str | None, dtype: str, device: torch.device, max_model_len: int | None,
                max_logprobs: int, *, logprobs_mode: str = DEFAULT_LOGPROBS_MODE) -> "ModelConfig":
        from kvserve.model_loader.loader import ModelSource, load_hf_config
        from kvserve.model_loader.architectures import resolve_architecture

        source = ModelSource.resolve(model)
        hf_config = load_hf_config(source)
        architecture, _ = resolve_architecture(hf_config)
        stored = checkpoint_dtype(hf_config) if source.kind == "hf" else None
        return cls(source, hf_config, architecture, resolve_dtype(dtype, device, stored),
                   resolve_max_model_len(hf_config, max_model_len), max_logprobs, model or "SmolLM2-135M-Instruct",
                   logprobs_mode)


def checkpoint_dtype(hf_config) -> torch.dtype | None:
    """The dtype a Hugging Face checkpoint says its weights are stored in (config.json `torch_dtype`/`dtype`)."""
    stored = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(stored, str):
        stored = _DTYPES.get(stored.removeprefix("torch."))
    return stored if isinstance(stored, torch.dtype) else None


def resolve_dtype(name: str, device: torch.device, stored: torch.dtype | None = None) -> torch.dtype:
    """`auto`, as vLLM's: the checkpoint's own precision, with half precision as bf16. On a CPU bf16 needs
    AVX512_BF16 or AMX; `stored` None (a GGUF file, dequantized at load) or fp32 runs in fp32."""
    from kvserve.utils import cpu_features

    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        # NOTE: on a CPU with native bf16, `kvserve bench quality --dtype bfloat16` gives 97.4% top-1 agreement
        # with fp32 (docs/features/bf16.md): above the 97% bar int8 weights are held to, and 1.3-2x faster.
        # Without AVX512_BF16/AMX (the AVX2 CPUs we also target) bf16 matmuls run under 1 GFLOP/s.
        if stored in (torch.bfloat16, torch.float16) and cpu_features.native_bf16():
            return torch.bfloat16
        if stored in (torch.bfloat16, torch.float16):
            logger.info("dtype auto: float32 for a %s checkpoint: this CPU has no native bf16 (AVX512_BF16/AMX)",
                        stored)
        return torch.float32
    dtype = _DTYPES[name]
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_features.native_bf16():
        # A documented fallback, not an error: results are right, and the cache and weights half the size.
        logger.warning("--dtype bfloat16 on a CPU without AVX512_BF16 or AMX: the linear layers keep bf16 weights "
                       "and multiply them in float32 (layers/quant/bf16.py); the KV cache is bf16, widened to "
                       "float32 in the attention kernels; the other ops run PyTorch's bf16 code. --dtype float32 "
                       "avoids its roundings")
    return dtype


def resolve_max_model_len(hf_config, requested: int | None) -> int:
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's limit of {limit} tokens")
    return requested
