"""The GGUF architectures we read beyond `llama`, as llama.cpp's converter (convert_hf_to_gguf.py) writes them
and the `gguf` package names them (gguf.MODEL_ARCH / TENSOR_NAMES): for each, the HF architecture it comes back
as, GGUF tensor name -> HF checkpoint name, which Q/K rows the converter permuted, and the metadata keys that
differ from Llama's (gguf_loader.py reads those).

Experts: the converter stacks every expert of a layer into one tensor per projection, `ffn_gate_exps` /
`ffn_up_exps` [E, I, H] and `ffn_down_exps` [E, H, I]; gate and up come back concatenated as the stacked
tensors our FusedMoE loads (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`; Granite-MoE's
`input_linear` / `output_linear`), named as model_loader/architectures.py's ArchFeatures says.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kvserve.model_loader.architectures import ARCHITECTURES

# GGUF per-layer suffix -> HF per-layer suffix shared by the Llama-shaped architectures.
LLAMA_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QKV_BIAS = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
             "attn_v.bias": "self_attn.v_proj.bias"}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
GATE_EXPS, UP_EXPS, DOWN_EXPS = "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"


@dataclass(frozen=True)
class GGUFArch:
    """One GGUF architecture: what it loads as, and how its tensors are named and laid out."""

    hf_architecture: str
    model_type: str
    layer_tensors: dict[str, str]
    permute_qk: bool = False
    """llama.cpp's LlamaModel converter reorders Q/K rows for its adjacent-pair RoPE; undone at load."""
    moe_hf_architecture: str | None = None
    """What a file of this architecture with experts loads as (GGUF `llama` with experts: Mixtral)."""
    norm_shift: float = 0.0
    """Gemma: the converter stores every RMSNorm weight as 1 + w (llama.cpp's norm is plain x * w)."""


def _moe_tensors(hf_architecture: str) -> dict[str, str]:
    """The router and stacked experts of an architecture, under its checkpoint names (ArchFeatures)."""
    feats = ARCHITECTURES.get(hf_architecture)
    prefix, router, stacked = ("mlp", "gate", ("experts.gate_up_proj", "experts.down_proj")) if feats is None else (
        feats.moe_prefix, feats.router_name, feats.stacked_expert_names)
    return {"ffn_gate_inp.weight": f"{prefix}.{router}.weight", GATE_EXPS: f"{prefix}.{stacked[0]}",
            UP_EXPS: f"{prefix}.{stacked[0]}", DOWN_EXPS: f"{prefix}.{stacked[1]}"}


_QWEN2_SHARED = {"ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                 "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                 "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
                 "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
_GEMMA_LAYER_TENSORS = {k: v for k, v in LLAMA_LAYER_TENSORS.items() if k != "ffn_norm.weight"} | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_DEEPSEEK2_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",                       # V2-Lite: no q LoRA
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",                 # older files: kv_b whole
    "attn_k_b.weight": "self_attn.kv_b_proj.weight",                  # newer: split (gguf_loader rejoins them)
    "attn_v_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}

GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", "llama", LLAMA_LAYER_TENSORS, permute_qk=True,
                      moe_hf_architecture="MixtralForCausalLM"),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", LLAMA_LAYER_TENSORS | _QKV_BIAS),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3", LLAMA_LAYER_TENSORS | _QK_NORM),
    "qwen2moe": GGUFArch("Qwen2MoeForCausalLM", "qwen2_moe", LLAMA_LAYER_TENSORS | _QKV_BIAS | _QWEN2_SHARED),
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM", "qwen3_moe", LLAMA_LAYER_TENSORS | _QK_NORM),
    "olmoe": GGUFArch("OlmoeForCausalLM", "olmoe", LLAMA_LAYER_TENSORS | _QK_NORM),
    "phi3": GGUFArch("Phi3ForCausalLM", "phi3", {k: v for k, v in LLAMA_LAYER_TENSORS.items()
                                                 if not k.startswith(("attn_q.", "attn_k.", "attn_v.", "ffn_gate"))}
                     | {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}),
    "granite": GGUFArch("GraniteForCausalLM", "granite", LLAMA_LAYER_TENSORS, permute_qk=True),
    "granitemoe": GGUFArch("GraniteMoeForCausalLM", "granitemoe", LLAMA_LAYER_TENSORS, permute_qk=True),
    "gemma2": GGUFArch("Gemma2ForCausalLM", "gemma2", _GEMMA_LAYER_TENSORS, norm_shift=1.0),
    "gemma3": GGUFArch("Gemma3ForCausalLM", "gemma3_text", _GEMMA_LAYER_TENSORS | _QK_NORM, norm_shift=1.0),
    "deepseek2": GGUFArch("DeepseekV2ForCausalLM", "deepseek_v2", _DEEPSEEK2_LAYER_TENSORS),
}
"""By GGUF `general.architecture`. DeepSeek-V3 files are `deepseek2` too (sigmoid gating tells them apart)."""


def layer_tensors(arch: GGUFArch, hf_architecture: str) -> dict[str, str]:
    """Every per-layer GGUF suffix -> HF suffix of `arch` loading as `hf_architecture` (experts included)."""
    return _moe_tensors(hf_architecture) | arch.layer_tensors


_PER_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")


def per_expert_name(suffix: str, hf_architecture: str) -> str | None:
    """The HF name of one expert's projection in the first Mixtral GGUF files (`ffn_gate.{e}.weight`, one
    tensor per expert, before the converter stacked them), or None for any other suffix."""
    match = _PER_EXPERT_RE.match(suffix)
    feats = ARCHITECTURES.get(hf_architecture)
    if match is None or feats is None or not feats.moe:
        return None
    which = ("gate", "up", "down").index(match.group(1))
    return f"{feats.moe_prefix}.experts.{match.group(2)}.{feats.expert_names[which]}.weight"
