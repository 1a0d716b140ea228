"""Checkpoint tensors (Hugging Face names) -> the model's layers, strictly (as nanoGPT's `from_pretrained`
asserts): every parameter is filled by exactly the tensors it expects, each of the right shape, and any
tensor we do not know is an error naming it. Each layer copies its own part (fused parts, rank shards).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from kvserve.model_loader.lazy_tensor import materialize

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# Our fused module -> the checkpoint's separate modules, with the shard id each fills.
_FUSED = {"self_attn.qkv_proj": [("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v")],
          "mlp.gate_up_proj": [("mlp.gate_proj", 0), ("mlp.up_proj", 1)]}


def expected_tensors(model: nn.Module) -> dict[str, tuple[str, str, object]]:
    """Checkpoint name -> (our module path, parameter name, shard id) for every tensor the model needs."""
    expected = {}
    for pname, _ in model.named_parameters():  # NOTE: a tied LM head shares the embedding: listed once
        module_path, _, attr = pname.rpartition(".")
        prefix = "" if pname.startswith("lm_head") else "model."
        fused = next((f for f in _FUSED if module_path.endswith(f)), None)
        if fused is None:
            expected[f"{prefix}{pname}"] = (module_path, attr, None)
            continue
        for part, shard_id in _FUSED[fused]:
            expected[f"{prefix}{module_path[:-len(fused)]}{part}.{attr}"] = (module_path, attr, shard_id)
    return expected


def load_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the model, strictly; then let every layer finish its weights
    (process_weights_after_loading: prepacking, quantizing)."""
    expected = expected_tensors(model)
    tied = getattr(getattr(model, "lm_head", None), "tied", False)
    seen: set[str] = set()
    unexpected = []
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and tied:
            continue  # tied checkpoints sometimes store the shared matrix twice
        if name not in expected:
            unexpected.append(name)
            continue
        if name in seen:
            raise ValueError(f"checkpoint tensor {name} appears twice")
        module_path, attr, shard_id = expected[name]
        module = model.get_submodule(module_path)
        try:
            if hasattr(module, "weight_loader"):
                module.weight_loader(attr, tensor, shard_id)
            else:
                _copy_whole(getattr(module, attr).data, tensor)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name} {e}") from None
        seen.add(name)
    if unexpected:
        raise ValueError(_name_list("unexpected tensors in checkpoint", unexpected))
    missing = [n for n in expected if n not in seen]
    if missing:
        raise ValueError(_name_list("checkpoint is missing tensors", missing))
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


def _copy_whole(dest: torch.Tensor, src: torch.Tensor) -> None:
    src = materialize(src)
    if tuple(dest.shape) != tuple(src.shape):
        raise ValueError(f"has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(src)


def _name_list(what: str, names: list[str]) -> str:
    return f"{what}: {', '.join(sorted(names)[:10])}" + (f" ... ({len(names)} in all)" if len(names) > 10 else "")
