"""What transformers' own GGUF support reads from a GGUF file (the oracle of the GGUF loader tests)."""
from __future__ import annotations

import os

import torch
from transformers import AutoConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint


def hf_gguf_config(path: str):
    return AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def hf_gguf_tensors(path: str, config=None) -> dict[str, torch.Tensor]:
    """What `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` loads into the model.

    NOTE: from_pretrained with gguf_file insists on `accelerate` (not a kvserve dependency),
    so call the function it delegates to, `load_gguf_checkpoint`, with the same arguments.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config if config is not None else hf_gguf_config(path))
    return load_gguf_checkpoint(path, return_tensors=True, model_to_load=model, torch_dtype=torch.float32)["tensors"]
