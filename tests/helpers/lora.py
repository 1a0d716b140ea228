"""PEFT LoRA adapters over a tiny checkpoint, shared by the one-rank and tensor-parallel LoRA tests."""
from __future__ import annotations

import copy

import torch

# name -> (target modules, use_rslora): attention only, MLP + o_proj with rsLoRA, every module
ADAPTERS = {"attn": (["q_proj", "v_proj"], False),
            "mlp_rs": (["o_proj", "gate_proj", "down_proj"], True),
            "all": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False)}


def make_adapter(base, path: str, targets: list[str], rslora: bool, seed: int, r: int = 8):
    import peft

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=16, target_modules=targets, init_lora_weights=False, use_rslora=rslora)
    model = peft.get_peft_model(copy.deepcopy(base), cfg).eval()
    model.save_pretrained(path)
    return model
