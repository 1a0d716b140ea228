"""A GGUF file's metadata -> the transformers config of its architecture (gguf_archs.py): llama.cpp's keys
(`{arch}.block_count`, `{arch}.expert_count`, ...) under HF's names, and what the file says only through its
tensors (which layers have experts, a tied LM head) or llama.cpp fixes per architecture (Gemma's window
patterns, the query scale of the 27B Gemmas).
"""
from __future__ import annotations

from typing import Any

import gguf

from kvserve.model_loader.gguf_archs import GGUF_ARCHS, GGUFArch
from kvserve.model_loader.gguf_file import GGUFFile

# llama.cpp's fixed Gemma attention layouts: every n-th layer global, the rest windowed, rope 10k on those
_GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_SWA_ROPE_THETA = 10000.0
# llama.cpp scales queries by 1/sqrt(hidden / heads) in these (27B) models, by 1/sqrt(head_dim) in the others
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.field(key, default)


class Metadata:
    """The `{arch}.`-prefixed keys of one file."""

    def __init__(self, reader: GGUFFile, path: str):
        self.reader, self.path = reader, path
        self.arch = field(reader, "general.architecture")

    def get(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        full_key = f"{self.arch}.{key}"
        value = field(self.reader, full_key, default)
        if required and value is None:
            raise ValueError(f"{self.path}: GGUF metadata key {full_key!r} is missing")
        return value

    def uniform(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """A key llama.cpp may store per layer (head_count_kv): one value for every layer, as HF has."""
        value = self.get(key, default, required=required)
        if isinstance(value, list):
            if not value or any(v != value[0] for v in value):
                raise ValueError(f"{self.path}: per-layer values for {key!r} are not supported (got {value})")
            return value[0]
        return value


def rope_scaling(m: Metadata) -> dict[str, Any] | None:
    """HF `rope_scaling` dict from llama.cpp's `rope.scaling.*` keys, or None if unscaled."""
    scaling_type, factor = m.get("rope.scaling.type"), m.get("rope.scaling.factor")
    legacy_linear = m.get("rope.scale_linear")  # pre-2023-11 files
    if scaling_type is None and legacy_linear is not None:
        scaling_type, factor = "linear", legacy_linear
    if scaling_type in (None, "none") or (scaling_type == "linear" and factor in (None, 1.0)):
        return None
    if factor is None:
        raise ValueError(f"{m.path}: rope scaling type {scaling_type!r} has no rope.scaling.factor")
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if scaling_type != "yarn":
        raise ValueError(f"{m.path}: rope scaling type {scaling_type!r} is not supported (only linear and yarn)")
    scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
    original = m.get("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                             ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if m.get(gguf_key) is not None:
            scaling[hf_key] = float(m.get(gguf_key))
    log_mul = m.get("rope.scaling.yarn_log_multiplier")
    if log_mul:  # DeepSeek: the converter writes 0.1 * mscale_all_dim (its releases have mscale == mscale_all_dim)
        scaling["mscale"] = scaling["mscale_all_dim"] = float(log_mul) / 0.1
    # llama.cpp's attn_factor is an extra multiplier on top of YaRN's own attention scale,
    # which HF's `attention_factor` replaces; refuse rather than guess a conversion.
    attn_factor = m.get("rope.scaling.attn_factor")
    if attn_factor not in (None, 1.0):
        raise ValueError(f"{m.path}: rope.scaling.attn_factor {attn_factor} is not supported")
    return scaling


def _common(m: Metadata, arch: GGUFArch) -> dict[str, Any]:
    """The Llama keys every architecture has."""
    hidden_size = int(m.get("embedding_length", required=True))
    num_heads = int(m.uniform("attention.head_count", required=True))
    key_length, rope_dims = m.get("attention.key_length"), m.get("rope.dimension_count")
    head_dim = int(key_length if key_length is not None else rope_dims if rope_dims is not None
                   else hidden_size // num_heads)
    if rope_dims is not None and int(rope_dims) != head_dim and arch.model_type != "deepseek_v2":
        # HF Llama rotates the whole head; partial rotary would silently change the model.
        raise ValueError(f"{m.path}: rope.dimension_count {rope_dims} != head_dim {head_dim} (partial RoPE) is not "
                         "supported")
    vocab_size = m.get("vocab_size")
    if vocab_size is None:
        # NOTE: older converters omit {arch}.vocab_size; the token list is authoritative then.
        tokens = m.reader.field("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"{m.path}: neither {m.arch}.vocab_size nor tokenizer.ggml.tokens is present")
        vocab_size = len(tokens)
    kwargs: dict[str, Any] = dict(
        vocab_size=int(vocab_size), hidden_size=hidden_size, num_hidden_layers=int(m.get("block_count", required=True)),
        num_attention_heads=num_heads, num_key_value_heads=int(m.uniform("attention.head_count_kv", num_heads)),
        head_dim=head_dim, rms_norm_eps=float(m.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(m.get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(m.get("context_length", required=True)),
        tie_word_embeddings=not any(t.name == "output.weight" for t in m.reader.tensors),
        bos_token_id=field(m.reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field(m.reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=field(m.reader, "tokenizer.ggml.padding_token_id"),
    )
    if m.get("feed_forward_length") is not None:
        kwargs["intermediate_size"] = int(m.uniform("feed_forward_length"))
    scaling = rope_scaling(m)
    if scaling is not None:
        kwargs["rope_scaling"] = scaling
    return kwargs


def _moe(m: Metadata, model_type: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Experts: counts, widths, and (Qwen) the dense layers, which are those without a router tensor."""
    expert_width = m.get("expert_feed_forward_length") or kwargs.get("intermediate_size")
    if expert_width is None:
        raise ValueError(f"{m.path}: GGUF metadata key '{m.arch}.expert_feed_forward_length' is missing")
    count, used = int(m.get("expert_count")), int(m.get("expert_used_count", required=True))
    norm = m.get("expert_weights_norm")
    if model_type in ("qwen2_moe", "qwen3_moe"):
        routers = {t.name for t in m.reader.tensors if t.name.endswith(".ffn_gate_inp.weight")}
        out = dict(num_experts=count, num_experts_per_tok=used, moe_intermediate_size=int(expert_width),
                   decoder_sparse_step=1, norm_topk_prob=bool(norm if norm is not None else model_type == "qwen3_moe"),
                   mlp_only_layers=[i for i in range(kwargs["num_hidden_layers"])
                                    if f"blk.{i}.ffn_gate_inp.weight" not in routers])
        out.setdefault("intermediate_size", kwargs.get("intermediate_size", int(expert_width)))
        if m.get("expert_shared_feed_forward_length"):
            out["shared_expert_intermediate_size"] = int(m.get("expert_shared_feed_forward_length"))
        return out
    experts_key = "num_experts" if model_type == "olmoe" else "num_local_experts"
    out = {experts_key: count, "num_experts_per_tok": used, "intermediate_size": int(expert_width)}
    if model_type == "olmoe":
        out["norm_topk_prob"] = bool(norm)
    return out


def _granite(m: Metadata, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The four multipliers, which the converter writes as scales."""
    keys = {"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
            "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}
    return {hf: float(m.get(key)) for key, hf in keys.items() if m.get(key) is not None}


def _phi3(m: Metadata, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Phi-3-mini's window (its converter writes the config's sliding_window), on every layer as transformers
    applies it."""
    window = m.get("attention.sliding_window")
    return {"sliding_window": int(window)} if window else {"sliding_window": None}


def _olmoe(m: Metadata, kwargs: dict[str, Any]) -> dict[str, Any]:
    clip = m.get("attention.clamp_kqv")
    return {"clip_qkv": float(clip)} if clip else {}


def _gemma(m: Metadata, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Windows, soft caps, the query scale and (Gemma 3) the two RoPE bases."""
    n = kwargs["num_hidden_layers"]
    pattern = m.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):          # newer files: one flag per layer, True where windowed
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        every = int(pattern or _GEMMA_WINDOW_PATTERN[m.arch])
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    scalar = (kwargs["hidden_size"] // kwargs["num_attention_heads"] if n == _GEMMA_27B_LAYERS[m.arch]
              else kwargs["head_dim"])
    out: dict[str, Any] = dict(layer_types=types, sliding_window=m.get("attention.sliding_window"),
                               query_pre_attn_scalar=scalar, hidden_activation="gelu_pytorch_tanh")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        out[key] = m.get(key)
    if m.arch == "gemma3":
        full = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
        full |= kwargs.pop("rope_scaling", {})
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": float(m.get("rope.freq_base_swa", _GEMMA_SWA_ROPE_THETA))}}
    return out


def _deepseek2(m: Metadata, kwargs: dict[str, Any]) -> dict[str, Any]:
    """MLA widths (older files: K/V widths per head; newer, MLA stored as MQA: the *_mla keys), experts and
    their routing. Sigmoid gating is DeepSeek-V3's (its grouped top-k with a correction bias)."""
    rope = int(m.get("rope.dimension_count", required=True))
    key_mla, value_mla = m.get("attention.key_length_mla"), m.get("attention.value_length_mla")
    key_length = int(key_mla if key_mla is not None else m.get("attention.key_length", required=True))
    value_length = int(value_mla if value_mla is not None else m.get("attention.value_length", required=True))
    v3 = m.get("expert_gating_func") == int(gguf.ExpertGatingFuncType.SIGMOID)
    out: dict[str, Any] = dict(
        model_type="deepseek_v3" if v3 else "deepseek_v2",
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        num_key_value_heads=kwargs["num_attention_heads"], head_dim=rope,
        q_lora_rank=m.get("attention.q_lora_rank"), kv_lora_rank=int(m.get("attention.kv_lora_rank", required=True)),
        qk_rope_head_dim=rope, qk_nope_head_dim=key_length - rope, v_head_dim=value_length,
        first_k_dense_replace=int(m.get("leading_dense_block_count", 0)),
        n_shared_experts=m.get("expert_shared_count"), routed_scaling_factor=float(m.get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(m.get("expert_weights_norm", False)), n_group=m.get("expert_group_count"),
        topk_group=m.get("expert_group_used_count"),
    )
    if m.get("expert_count"):
        out |= dict(n_routed_experts=int(m.get("expert_count")),
                    num_experts_per_tok=int(m.get("expert_used_count", required=True)),
                    moe_intermediate_size=int(m.get("expert_feed_forward_length", required=True)))
    if not v3 and out["n_group"] and out["n_group"] > 1:
        out["topk_method"] = "group_limited_greedy"
    return out


_EXTRAS = {"granite": _granite, "granitemoe": _granite, "olmoe": _olmoe, "phi3": _phi3, "gemma2": _gemma, "gemma3": _gemma,
           "deepseek2": _deepseek2}


def config_from_reader(reader: GGUFFile, path: str):
    """The transformers config of the file's architecture (LlamaConfig for `llama`, MixtralConfig for `llama`
    with experts, Qwen3MoeConfig for `qwen3moe`, ...), `architectures` set to the HF class it loads as."""
    from transformers import AutoConfig

    m = Metadata(reader, path)
    arch = GGUF_ARCHS[m.arch]
    kwargs = _common(m, arch)
    hf_architecture, model_type = arch.hf_architecture, arch.model_type
    if m.get("expert_count") and arch.moe_hf_architecture:
        hf_architecture, model_type = arch.moe_hf_architecture, "mixtral"
    kwargs["architectures"] = [hf_architecture]
    if m.get("expert_count") and m.arch != "deepseek2":
        kwargs |= _moe(m, model_type, kwargs)
    if m.arch in _EXTRAS:
        kwargs |= _EXTRAS[m.arch](m, kwargs)
    model_type = kwargs.pop("model_type", model_type)
    # NOTE: rope_theta/rope_scaling are the transformers 4.x names; 5.x folds them into `rope_parameters`
    # itself, so one spelling works for both.
    return AutoConfig.for_model(model_type, **kwargs)
