"""kvserve: LLM inference and serving on PyTorch (paged KV cache, continuous batching, chunked prefill)."""
from kvserve.engine.llm import LLM
from kvserve.lora.request import LoRARequest
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "LoRARequest", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
