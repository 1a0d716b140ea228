"""Write a transformers model as a GGUF file the way llama.cpp's converter (convert_hf_to_gguf.py) does, for the
GGUF loader tests: its tensor names, its Q/K row permutation (Llama, Granite), experts stacked per projection,
Phi-3's fused tensors, the metadata keys, and the SmolLM2 tokenizer copied from the built-in GGUF (the tiny
models share its 49152-token vocabulary). Written from the converter's conventions, independently of
kvserve/model_loader (whose reading is what the tests check).

Weights may be stored quantized: Q8_0/Q4_0 through gguf's own quantize, and K-quants (Q4_K, Q5_K, Q6_K, which
the gguf package dequantizes but cannot quantize) as random blocks. Either way the transformers model's
parameters are set to the dequantized values, so it is the oracle on exactly the file's weights.
"""
from __future__ import annotations

import functools

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)

_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
         "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "phi3": "phi3", "granite": "granite", "granitemoe": "granitemoe",
         "gemma2": "gemma2", "gemma3_text": "gemma3",
         "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}
_PERMUTED = ("llama", "granite", "granitemoe")  # LlamaModel and its subclasses in the converter
_LAYER = {  # transformers' in-memory names (v5) -> llama.cpp's, within a layer
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.router.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight", "block_sparse_moe.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_GEMMA_LAYER = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_DEEPSEEK_LAYER = {
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_GATE_UP = ("mlp.experts.gate_up_proj", "block_sparse_moe.experts.gate_up_proj")
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_KEEP_F32 = ("norm.weight", ".bias", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


@functools.cache
def _tokenizer_fields() -> list[tuple[str, object, list]]:
    from kvserve.model_loader.gguf_loader import builtin_model_path

    reader = gguf.GGUFReader(builtin_model_path())
    return [(f.name, f.contents(), f.types) for f in reader.fields.values() if f.name.startswith("tokenizer.")]


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute on whole rows (of weights, or of a quantized row's blocks)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _kquant_blocks(shape: tuple[int, ...], qtype, rng: np.random.Generator, std: float) -> np.ndarray:
    """Random K-quant blocks [..., rows, bytes] whose weights have about `std` and mean 0."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, nbytes), dtype=np.uint8)

    def set_scales(d: float):
        if qtype == Q.Q6_K:                                    # ql, qh, int8 scales, then d
            raw[..., -2:] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        else:                                                  # d, dmin first; w = d * sc * q - dmin * m
            raw[..., 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
            raw[..., 2:4] = np.frombuffer(np.float16(d * (7.5 if qtype == Q.Q4_K else 15.5)).tobytes(), np.uint8)

    set_scales(1e-3)
    measured = gguf.quants.dequantize(raw.reshape(*shape[:-1], -1), qtype).std()
    set_scales(1e-3 * std / measured)
    return raw.reshape(*shape[:-1], -1)


def _encode(w: np.ndarray, qtype, rng) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, its dequantized float32 weights) for weights `w` [..., rows, cols]."""
    if qtype == Q.F32:
        return w, w
    if qtype == Q.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    raw = _kquant_blocks(w.shape, qtype, rng, float(w.std())) if qtype in K_QUANTS else gguf.quants.quantize(w, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(w.shape).astype(np.float32)


def _metadata(writer: gguf.GGUFWriter, cfg, arch: str, split_kv_b: bool) -> None:
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or \
        getattr(cfg, "n_routed_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "deepseek2":
        _deepseek_metadata(writer, cfg, split_kv_b)
    else:
        writer.add_head_count_kv(cfg.num_key_value_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if head_dim != cfg.hidden_size // cfg.num_attention_heads:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
    if arch.startswith("granite"):
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    if arch == "phi3":  # 0: no window (how the converter tells Phi-4 from Phi-3-mini's 2047)
        writer.add_sliding_window(cfg.sliding_window or 0)
    if getattr(cfg, "clip_qkv", None):  # OLMo's converter key; the OLMoE releases have no clip (theirs writes none)
        writer.add_clamp_kqv(cfg.clip_qkv)
    if arch.startswith("gemma"):
        writer.add_sliding_window(cfg.sliding_window)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for key, value, types in _tokenizer_fields():
        writer.add_key_value(key, value, types[0], types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None)


def _deepseek_metadata(writer: gguf.GGUFWriter, cfg, split_kv_b: bool) -> None:
    """MLA as the converter writes it: K/V widths per head, or (split kv_b, newer files) as MQA over the latent."""
    rope, nope, v = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    writer.add_rope_dimension_count(rope)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    if split_kv_b:
        writer.add_head_count_kv(1)
        writer.add_key_length(cfg.kv_lora_rank + rope)
        writer.add_value_length(cfg.kv_lora_rank)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(v)
    else:
        writer.add_head_count_kv(cfg.num_key_value_heads)
        writer.add_key_length(nope + rope)
        writer.add_value_length(v)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    v3 = cfg.model_type == "deepseek_v3"
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if getattr(cfg, "n_group", None):
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)


def _gguf_name(name: str, arch: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    local = name.split(".", 3)[-1]
    table = _LAYER | (_GEMMA_LAYER if arch.startswith("gemma") else {}) | (
        _DEEPSEEK_LAYER if arch == "deepseek2" else {})
    return f"blk.{name.split('.')[2]}.{table.get(local, local)}"


@torch.no_grad()
def write_gguf(path: str, model, model_type: str, qtype=Q.F32, seed: int = 0, split_kv_b: bool = True,
               per_expert: bool = False) -> None:
    """Write `model` (a transformers causal LM of `model_type`) to `path`; layer matrices stored as `qtype` where
    their rows split into its blocks (else F32), and the model's parameters set to what the file holds.
    split_kv_b: DeepSeek's kv_b_proj as the newer converter writes it (k_b transposed, v_b), else whole.
    per_expert: one tensor per expert and projection (`ffn_gate.{e}.weight`), as the first Mixtral files."""
    cfg, arch = model.config, _ARCH[model_type]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch)
    _metadata(writer, cfg, arch, split_kv_b)
    for name, p in model.state_dict().items():       # NOTE: tensors sharing the parameters' memory (buffers too)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gguf_name, local = _gguf_name(name, arch), name.split(".", 3)[-1]
        w = p.float().numpy()
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        quant = qtype if gguf_name.startswith("blk.") and not gguf_name.endswith(_KEEP_F32) and \
            w.ndim >= 2 and w.shape[-1] % block == 0 else Q.F32
        raw, deq = _encode(w, quant, rng)
        p.copy_(torch.from_numpy(deq).reshape(p.shape))
        if arch.startswith("gemma") and gguf_name.endswith("norm.weight"):
            raw = raw + np.float32(1.0)                 # Gemma's 1 + w, which llama.cpp's plain norm needs stored
        if arch in _PERMUTED and local in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            raw = _permute(raw, cfg.num_attention_heads if "q_proj" in local else cfg.num_key_value_heads)
        for part_name, part in _parts(gguf_name, local, raw, cfg, split_kv_b):
            if per_expert and "_exps." in part_name:
                for e, rows in enumerate(part):
                    _add(writer, part_name.replace("_exps.", f".{e}."), np.ascontiguousarray(rows), quant)
                continue
            _add(writer, part_name, part, quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _parts(gguf_name: str, local: str, raw: np.ndarray, cfg, split_kv_b: bool):
    """The tensors the converter writes for one of transformers': experts' gate and up apart, DeepSeek's kv_b
    split in k_b (transposed) and v_b."""
    layer = gguf_name.split(".")[1] if gguf_name.startswith("blk.") else None
    if gguf_name.endswith("ffn_gate_inp_shexp.weight"):  # llama.cpp holds Qwen2-MoE's [1, H] gate as [H]
        return [(gguf_name, raw.reshape(-1))]
    if local in _GATE_UP:                              # [E, 2I, H]
        half = raw.shape[1] // 2
        return [(f"blk.{layer}.ffn_gate_exps.weight", raw[:, :half]),
                (f"blk.{layer}.ffn_up_exps.weight", raw[:, half:])]
    if local == "self_attn.kv_b_proj.weight" and split_kv_b:
        nope = cfg.qk_nope_head_dim
        kv_b = raw.reshape(cfg.num_attention_heads, nope + cfg.v_head_dim, raw.shape[-1])
        return [(f"blk.{layer}.attn_k_b.weight", kv_b[:, :nope].transpose(0, 2, 1)),
                (f"blk.{layer}.attn_v_b.weight", kv_b[:, nope:])]
    return [(gguf_name, raw)]


def _add(writer: gguf.GGUFWriter, name: str, raw: np.ndarray, qtype) -> None:
    if qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, np.ascontiguousarray(raw))
    else:
        writer.add_tensor(name, np.ascontiguousarray(raw), raw_dtype=qtype)
