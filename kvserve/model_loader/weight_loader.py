"""Checkpoint tensors (Hugging Face names) -> the model's layers, strictly (as nanoGPT's `from_pretrained`
asserts): every parameter is filled by exactly the tensors it expects, each of the right shape, and any
tensor we do not know is an error naming it. Each layer copies its own part (fused parts, rank shards).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.model_loader.lazy_tensor import materialize

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# Our fused module (its last name) -> the checkpoint's separate modules, with the shard id each fills.
_FUSED = {"qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
          "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)]}
# A checkpoint that stores them fused already (Phi-3): the whole tensor, split by the layer
_ALREADY_FUSED = {"qkv_proj": "qkv", "gate_up_proj": "fused"}
# A multimodal checkpoint served as text (ArchFeatures.multimodal_text): its text tensors' prefixes, as
# transformers 5 names them in memory and as checkpoints store them (which save_pretrained still writes), and the
# prefixes of the parts not served.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_NOT_SERVED = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: parameter `attr` of module `module_path`, part `shard_id`. Experts
    (layers/moe.py FusedMoE): `expert_id` (None for a tensor of every expert stacked, `stacked` True)."""

    module_path: str
    attr: str
    shard_id: object = None
    expert: bool = False
    expert_id: int | None = None
    stacked: bool = False


def expected_tensors(model: nn.Module) -> dict[str, Target]:
    """Checkpoint name -> Target for every tensor the model needs. A FusedMoE parameter is listed twice: per
    expert and stacked (a checkpoint holds one form)."""
    expected = {}
    fused_checkpoint = getattr(getattr(model, "feats", None), "fused_checkpoint", False)
    renames = {path: m.checkpoint_name for path, m in model.named_modules() if getattr(m, "checkpoint_name", None)}
    for pname, _ in model.named_parameters():  # NOTE: a tied LM head shares the embedding: listed once
        module_path, _, attr = pname.rpartition(".")
        prefix = "" if pname.startswith("lm_head") else "model."
        ckpt_path = _renamed(module_path, renames)
        module = model.get_submodule(module_path)
        if hasattr(module, "expert_mapping"):
            for param, name, expert_id, shard_id in module.expert_mapping():
                if param == attr:
                    expected[f"{prefix}{ckpt_path.rpartition('.')[0]}.{name}"] = Target(
                        module_path, attr, shard_id, expert=True, expert_id=expert_id, stacked=expert_id is None)
            continue
        parent, _, last = ckpt_path.rpartition(".")
        if last not in _FUSED:
            expected[f"{prefix}{ckpt_path}.{attr}"] = Target(module_path, attr)
        elif fused_checkpoint:
            expected[f"{prefix}{ckpt_path}.{attr}"] = Target(module_path, attr, _ALREADY_FUSED[last])
        else:
            for part, shard_id in _FUSED[last]:
                expected[f"{prefix}{parent}.{part}.{attr}"] = Target(module_path, attr, shard_id)
    return expected


def _renamed(module_path: str, renames: dict[str, str]) -> str:
    """`module_path` as the checkpoint names it: a module with a `checkpoint_name` (in `renames` by its path)
    stands under that name instead of its own."""
    parts = module_path.split(".")
    return ".".join(renames.get(".".join(parts[:i + 1]), part) for i, part in enumerate(parts))


def load_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the model, strictly; then let every layer finish its weights
    (process_weights_after_loading: prepacking, quantizing)."""
    expected = expected_tensors(model)
    tied = getattr(getattr(model, "lm_head", None), "tied", False)
    multimodal = getattr(getattr(model, "feats", None), "multimodal_text", False)
    seen: set[str] = set()
    unexpected = []
    skips = getattr(model, "skips_checkpoint_tensor", None)  # what a model knows it does not use
    for name, tensor in tensors:
        if multimodal:
            name = _text_name(name)
        if name is None or name.endswith(_IGNORED_SUFFIXES) or (skips is not None and skips(name)):
            continue
        if name == "lm_head.weight" and tied:
            continue  # tied checkpoints sometimes store the shared matrix twice
        if name not in expected:
            unexpected.append(name)
            continue
        if name in seen:
            raise ValueError(f"checkpoint tensor {name} appears twice")
        target = expected[name]
        module = model.get_submodule(target.module_path)
        try:
            if target.expert:
                module.weight_loader(target.attr, tensor, target.expert_id, target.shard_id)
            elif hasattr(module, "weight_loader"):
                module.weight_loader(target.attr, tensor, target.shard_id)
            else:
                _copy_whole(getattr(module, target.attr).data, tensor)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name} {e}") from None
        seen.add(name)
    if unexpected:
        raise ValueError(_name_list("unexpected tensors in checkpoint", unexpected))
    missing = _missing(expected, seen)
    if missing:
        raise ValueError(_name_list("checkpoint is missing tensors", missing))
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


def _text_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under the text model's name; None for a part that is not served."""
    if name.startswith(_NOT_SERVED):
        return None
    for theirs, ours in _TEXT_PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def _missing(expected: dict[str, Target], seen: set[str]) -> list[str]:
    """Expected names not seen. An expert parameter is whole from its stacked tensor or from every per-expert
    one: the missing per-expert names are reported once one of them is seen, else the stacked name. Both forms
    at once is an error."""
    started = {(expected[n].module_path, expected[n].attr) for n in seen if expected[n].expert and
               not expected[n].stacked}
    whole = {(expected[n].module_path, expected[n].attr): n for n in seen if expected[n].stacked}
    both = started & whole.keys()
    if both:
        raise ValueError(f"checkpoint holds both {whole[both.pop()]} and per-expert tensors of the same parameter")
    missing = []
    for name, t in expected.items():
        key = (t.module_path, t.attr)
        if name in seen or (t.expert and key in whole) or (t.expert and t.stacked == (key in started)):
            continue
        missing.append(name)
    return missing


def _copy_whole(dest: torch.Tensor, src: torch.Tensor) -> None:
    src = materialize(src)
    if tuple(dest.shape) != tuple(src.shape):
        raise ValueError(f"has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(src)


def _name_list(what: str, names: list[str]) -> str:
    return f"{what}: {', '.join(sorted(names)[:10])}" + (f" ... ({len(names)} in all)" if len(names) > 10 else "")
