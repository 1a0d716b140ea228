"""Supported architectures, keyed by the `architectures` field of a Hugging Face config, and what each changes
in the Llama network (models/llama.py), or which other network it is (Gemma: models/gemma.py). Read when a
config is resolved, before any model code is imported."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchFeatures:
    """What distinguishes the supported architectures from plain Llama."""

    qkv_bias: bool = False  # Qwen2
    qkv_bias_from_config: bool = False
    """Qwen2-MoE: the config's `qkv_bias` (default true) decides whether q, k and v are biased."""
    qk_norm: bool = False   # Qwen3: RMSNorm over head_dim on q and k before RoPE
    qk_norm_full_width: bool = False
    """OLMoE: RMSNorm over the whole q (and k) projection, not per head; with config.clip_qkv, q/k/v clamped."""
    moe: bool = False
    """Sparse MoE MLPs (layers/moe.py) in the layers the config names (moe_layer_indices)."""
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """An expert's gate, up and down projections as the checkpoint names them."""
    moe_prefix: str = "mlp"
    """The MoE block's name in the checkpoint (Mixtral: block_sparse_moe); ours is always `mlp`."""
    stacked_expert_names: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj")
    """Every expert's gate+up [E, 2I, H] and down [E, H, I] stacked in one tensor each, as the checkpoint names
    them within the block (transformers' own layout; Granite-MoE's input_linear / output_linear)."""
    router_name: str = "gate"
    """The router's name in the checkpoint, within the block (Granite-MoE: router.layer); ours is `gate`."""
    shared_expert: bool = False
    """Qwen2-MoE: a dense shared expert beside the routed ones, scaled by sigmoid(shared_expert_gate(x))."""
    fused_checkpoint: bool = False
    """Phi-3: the checkpoint stores qkv_proj and gate_up_proj already fused."""
    multipliers: bool = False
    """Granite: embedding_multiplier, attention_multiplier (the softmax scale), residual_multiplier,
    logits_scaling from the config."""
    tensor_parallel: bool = True
    """False where a layer needs the whole projection on one rank (OLMoE's full-width q/k norm)."""
    network: str = "llama"
    """Which network models/build.py builds: "llama" (models/llama.py), "gemma" (models/gemma.py) or "deepseek"
    (models/deepseek.py)."""
    attn_soft_cap: bool = False
    """Gemma 2: attention scores soft-capped at config.attn_logit_softcapping (transformers' Gemma 3 ignores it)."""
    multimodal_text: bool = False
    """A multimodal checkpoint served as text only (Gemma3ForConditionalGeneration): the network is built from
    its config's text_config (served_config), and only its text tensors are loaded (weight_loader.py)."""
    mla: bool = False
    """DeepSeek-V2/V3: Multi-head Latent Attention over a latent KV cache, DeepSeek's routing (models/deepseek.py)."""


_MOE = dict(moe=True)
ARCHITECTURES: dict[str, ArchFeatures] = {
    "LlamaForCausalLM": ArchFeatures(),
    "MistralForCausalLM": ArchFeatures(),
    "Qwen2ForCausalLM": ArchFeatures(qkv_bias=True),
    "Qwen3ForCausalLM": ArchFeatures(qk_norm=True),
    "Qwen3MoeForCausalLM": ArchFeatures(qk_norm=True, **_MOE),
    "MixtralForCausalLM": ArchFeatures(expert_names=("w1", "w3", "w2"), moe_prefix="block_sparse_moe", **_MOE),
    "Qwen2MoeForCausalLM": ArchFeatures(qkv_bias=True, qkv_bias_from_config=True, shared_expert=True, **_MOE),
    "OlmoeForCausalLM": ArchFeatures(qk_norm_full_width=True, tensor_parallel=False, **_MOE),
    "Phi3ForCausalLM": ArchFeatures(fused_checkpoint=True),
    "GraniteForCausalLM": ArchFeatures(multipliers=True),
    "GraniteMoeForCausalLM": ArchFeatures(multipliers=True, moe_prefix="block_sparse_moe", router_name="router.layer",
                                          stacked_expert_names=("input_linear.weight", "output_linear.weight"),
                                          **_MOE),
    "Gemma2ForCausalLM": ArchFeatures(network="gemma", attn_soft_cap=True),
    "Gemma3ForCausalLM": ArchFeatures(network="gemma", qk_norm=True),
    "Gemma3ForConditionalGeneration": ArchFeatures(network="gemma", qk_norm=True, multimodal_text=True),
    "DeepseekV2ForCausalLM": ArchFeatures(network="deepseek", mla=True, **_MOE),
    "DeepseekV3ForCausalLM": ArchFeatures(network="deepseek", mla=True, **_MOE),
}


def resolve_architecture(hf_config) -> tuple[str, ArchFeatures]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch, ARCHITECTURES[arch]
    raise ValueError(
        f"unsupported architecture {archs or getattr(hf_config, 'model_type', None)!r}; "
        f"supported: {', '.join(ARCHITECTURES)}")


def served_config(hf_config):
    """The config the network is built from: a multimodal one's text part (ArchFeatures.multimodal_text) under the
    multimodal architecture's name, else the config itself."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not any(ARCHITECTURES[a].multimodal_text for a in archs if a in ARCHITECTURES):
        return hf_config
    text = hf_config.get_text_config()
    text.architectures = archs
    if getattr(text, "dtype", None) is None:  # the checkpoint's dtype is recorded on the outer config
        text.dtype = getattr(hf_config, "dtype", None)
    if getattr(hf_config, "eos_token_id", None) is not None:  # instruct checkpoints list end-of-turn there too
        text.eos_token_id = hf_config.eos_token_id
    # NOTE: transformers' Gemma3ForConditionalGeneration does not soft-cap its logits, whatever the text config says
    text.final_logit_softcapping = None
    return text


def num_experts(hf_config) -> int:
    """Routed experts per MoE layer (Mixtral calls it num_local_experts)."""
    return int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0) or 0)


def moe_intermediate_size(hf_config) -> int:
    """One expert's MLP width (Mixtral and OLMoE: intermediate_size, every layer being sparse)."""
    return int(getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size)


def moe_layer_indices(hf_config, feats: ArchFeatures) -> set[int]:
    """The decoder layers whose MLP is sparse, as transformers' Qwen2-MoE/Qwen3-MoE decide: not in
    mlp_only_layers and (index + 1) a multiple of decoder_sparse_step (every layer when neither is set);
    DeepSeek's: from first_k_dense_replace on, every moe_layer_freq-th (transformers reads no moe_layer_freq:
    released checkpoints all say 1)."""
    if not feats.moe or num_experts(hf_config) == 0:
        return set()
    if feats.mla:
        first = int(getattr(hf_config, "first_k_dense_replace", None) or 0)
        freq = int(getattr(hf_config, "moe_layer_freq", None) or 1)
        return {i for i in range(hf_config.num_hidden_layers) if i >= first and i % freq == 0}
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = int(getattr(hf_config, "decoder_sparse_step", None) or 1)
    return {i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0}


def layer_sliding_windows(hf_config) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), as transformers decides: a config with
    `layer_types` windows its "sliding_attention" layers (Gemma 2/3, Qwen2/3 with use_sliding_window); one
    without (Mistral, Mixtral) windows every layer when `sliding_window` is set."""
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return [None] * n
    types = getattr(hf_config, "layer_types", None)
    if types:
        return [int(window) if t == "sliding_attention" else None for t in types]
    return [int(window)] * n


def block_release_window(hf_config) -> int | None:
    """The window past which a request's KV blocks may be released while it runs (kv_cache/window.py): the
    widest window when every layer has one; None when some layer attends to the whole sequence (it reads every
    block)."""
    if not getattr(hf_config, "sliding_window", None):
        return None
    windows = layer_sliding_windows(hf_config)
    return None if not windows or None in windows else max(windows)


def longrope_switch_length(hf_config, max_positions: int) -> int | None:
    """longrope (Phi-3 long-context): the sequence length M = original_max_position_embeddings past which
    transformers rotates with the long factors, when sequences of up to max_positions tokens can pass it; None
    for other RoPE types, or when none can (the short factors alone)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return None
    original = int(params.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings)
    return original if max_positions > original else None
