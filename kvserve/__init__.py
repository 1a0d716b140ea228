"""kvserve: LLM inference and serving on PyTorch (paged KV cache, continuous batching, chunked prefill)."""
from __future__ import annotations

import importlib

# NOTE: imported on first use (PEP 562), so `import kvserve.<anything>` does not import torch and the engine:
# `kvserve serve` starts its engine process before its own heavy imports (engine/engine_process.py).
_EXPORTS = {"LLM": "kvserve.engine.llm", "SamplingParams": "kvserve.sampling_params",
            "StructuredOutputsParams": "kvserve.sampling_params", "LoRARequest": "kvserve.lora.request",
            "RequestOutput": "kvserve.outputs", "CompletionOutput": "kvserve.outputs", "Logprob": "kvserve.outputs"}

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "LoRARequest", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
