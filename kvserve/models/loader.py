"""Load a checkpoint (Hugging Face folder, llama GGUF, or the built-in SmolLM2 GGUF) into our model.

Loading is strict, as nanoGPT's `from_pretrained` asserts: every parameter must be filled by exactly one
tensor of the right shape, and any tensor we do not know is an error naming it.
"""
from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.registry import resolve_architecture

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class ModelSource:
    """Where a model comes from, resolved from the --model argument."""

    kind: str   # "hf" or "gguf"
    path: str

    @classmethod
    def resolve(cls, model: str | None) -> "ModelSource":
        if model is None:
            from kvserve.models.gguf_loader import builtin_model_path
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
        from kvserve.models.gguf_loader import load_gguf_config
        cfg = load_gguf_config(source.path)
    else:
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(source.path, local_files_only=True)
    return normalize_config(cfg)


def normalize_config(cfg):
    """Fill the fields that configs leave implicit (MHA kv heads, head_dim)."""
    if getattr(cfg, "num_key_value_heads", None) is None:
        cfg.num_key_value_heads = cfg.num_attention_heads
    if getattr(cfg, "head_dim", None) is None:
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    return cfg


def load_tokenizer(source: ModelSource):
    if source.kind == "gguf":
        from kvserve.models.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(source.path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(source.path, local_files_only=True)


def iter_checkpoint_tensors(source: ModelSource, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    if source.kind == "gguf":
        from kvserve.models.gguf_loader import iter_gguf_tensors
        yield from iter_gguf_tensors(source.path, dtype)
        return
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(source.path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {source.path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype)


def build_model(hf_config, backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
                device: torch.device) -> LlamaForCausalLM:
    _, feats = resolve_architecture(hf_config)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, feats, backend, max_positions)
    model = model.to_empty(device=device).to(dtype)
    # Buffers are not in the checkpoint: recompute the RoPE tables on the real device.
    model.rope = type(model.rope)(hf_config, max_positions).to(device)
    return model


def _expected_hf_names(model: LlamaForCausalLM) -> dict[str, tuple[str, slice | None]]:
    """HF tensor name -> (our parameter, rows of it that the tensor fills; None = all)."""
    cfg = model.config
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    parts = {"self_attn.qkv_proj": [("self_attn.q_proj", q_size), ("self_attn.k_proj", kv_size),
                                    ("self_attn.v_proj", kv_size)],
             "mlp.gate_up_proj": [("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size)]}
    expected = {}
    for pname, _ in model.named_parameters():
        prefix = "" if pname.startswith("lm_head") else "model."
        fused = next((f for f in parts if f".{f}." in f".{pname}"), None)
        if fused is None:
            expected[prefix + pname] = (pname, None)
            continue
        start = 0
        for hf_part, size in parts[fused]:
            expected[prefix + pname.replace(fused, hf_part)] = (pname, slice(start, start + size))
            start += size
    return expected


def load_weights(model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors (HF names) into the model's fused parameters, strictly."""
    params = dict(model.named_parameters())
    expected = _expected_hf_names(model)
    seen: set[str] = set()
    unexpected = []
    for hf_name, tensor in tensors:
        if hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        if hf_name == "lm_head.weight" and model.lm_head is None:
            continue  # tied checkpoints sometimes store the shared matrix twice
        if hf_name not in expected:
            unexpected.append(hf_name)
            continue
        if hf_name in seen:
            raise ValueError(f"checkpoint tensor {hf_name} appears twice")
        pname, rows = expected[hf_name]
        dest = params[pname].data if rows is None else params[pname].data[rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        seen.add(hf_name)
    if unexpected:
        raise ValueError(_name_list("unexpected tensors in checkpoint", unexpected))
    missing = [n for n in expected if n not in seen]
    if missing:
        raise ValueError(_name_list("checkpoint is missing tensors", missing))


def _name_list(what: str, names: list[str]) -> str:
    return f"{what}: {', '.join(sorted(names)[:10])}" + (f" ... ({len(names)} in all)" if len(names) > 10 else "")
