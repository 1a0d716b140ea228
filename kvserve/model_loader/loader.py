"""Where a model comes from (Hugging Face folder, llama GGUF, or the built-in SmolLM2 GGUF): its config,
tokenizer and checkpoint tensors. The network built from its config is models/build.py's (weight_loader.py
fills it).
"""
from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvserve.kv_cache.sizing import attention_shape
from kvserve.model_loader.architectures import served_config
from kvserve.model_loader.lazy_tensor import safetensors_lazy

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """Where a model comes from, resolved from the --model argument."""

    kind: str   # "hf" or "gguf"
    path: str

    @classmethod
    def resolve(cls, model: str | None) -> "ModelSource":
        if model is None:
            from kvserve.model_loader.gguf_loader import builtin_model_path
            return cls("gguf", builtin_model_path())
        if model.endswith(".gguf"):
            if not os.path.isfile(model):
                raise ValueError(f"GGUF file not found: {model}")
            return cls("gguf", model)
        if os.path.isdir(model):
            if not os.path.isfile(os.path.join(model, "config.json")):
                raise ValueError(f"{model} has no config.json: not a Hugging Face model folder")
            return cls("hf", model)
        raise ValueError(f"model not found: {model!r} (expected a Hugging Face folder or a .gguf file; "
                         "nothing is downloaded)")


def load_hf_config(source: ModelSource):
    if source.kind == "gguf":
        from kvserve.model_loader.gguf_loader import load_gguf_config
        cfg = load_gguf_config(source.path)
    else:
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(source.path, local_files_only=True)
    return normalize_config(served_config(cfg))


def normalize_config(cfg):
    """Fill the fields that configs leave implicit (MHA kv heads, head_dim), as sizing.attention_shape
    defines them."""
    _, cfg.num_key_value_heads, cfg.head_dim = attention_shape(cfg)
    return cfg


def load_tokenizer(source: ModelSource, allow_missing: bool = False):
    """allow_missing (--load-format dummy): a folder with no tokenizer files gets models.dummy.IdTokenizer."""
    if source.kind == "gguf":
        from kvserve.model_loader.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(source.path)
    from kvserve.model_loader.dummy import IdTokenizer, has_tokenizer
    if allow_missing and not has_tokenizer(source.path):
        logger.warning("%s has no tokenizer: prompts must be token ids, outputs are ids", source.path)
        return IdTokenizer()
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(source.path, local_files_only=True)


def iter_checkpoint_tensors(source: ModelSource, dtype: torch.dtype, keep_blocks: bool = False,
                            lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """keep_blocks: a GGUF file's quantized linear weights as stored (gguf_loader.iter_gguf_tensors).
    lazy: 2-D tensors come as LazyTensors (model_loader/lazy_tensor.py) that a sharded layer narrows to its slice
    before anything is read; each must be used before the next is asked for (the file closes after)."""
    if source.kind == "gguf":
        from kvserve.model_loader.gguf_loader import iter_gguf_tensors
        yield from iter_gguf_tensors(source.path, dtype, keep_blocks, lazy)
        return
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(source.path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {source.path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, safetensors_lazy(f, name, dtype) if lazy else f.get_tensor(name).to(dtype)
