"""Tiny random-weight checkpoints of the architectures beyond the Llama family (MoE, Phi-3, Granite, Gemma 2/3,
DeepSeek) and of sliding-window ones (Mistral, Qwen2 with windowed layers), built with transformers' own config
classes: every weight randomised, 1-D ones included."""
from __future__ import annotations

import os

import torch


def tiny_config(arch: str, **overrides):
    """The tiny config of `arch`, built by transformers' own config class; `overrides` replace or add constructor
    arguments (other shapes and RoPE variants: tests/engine/test_architecture_variants.py)."""
    import transformers as tf

    common = dict(vocab_size=49152, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  rms_norm_eps=1e-5)
    moe = dict(num_experts_per_tok=2, intermediate_size=96)
    if arch == "qwen3_moe":  # layer 1 dense (mlp_only_layers), per-head q/k norm, renormalised top-k
        cls, kwargs = tf.Qwen3MoeConfig, dict(**moe, num_hidden_layers=3, head_dim=32, num_experts=8,
                                              moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True)
    elif arch == "mixtral":    # every layer sparse, experts named w1/w3/w2 under block_sparse_moe
        cls, kwargs = tf.MixtralConfig, dict(num_experts_per_tok=2, intermediate_size=48, num_hidden_layers=2,
                                             num_local_experts=8, sliding_window=None)
    elif arch == "qwen2_moe":  # layers 1 and 3 sparse (decoder_sparse_step 2), a gated shared expert, qkv bias
        cls, kwargs = tf.Qwen2MoeConfig, dict(**moe, num_hidden_layers=4, num_experts=8, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, decoder_sparse_step=2,
                                              norm_topk_prob=False)
    elif arch == "olmoe":      # q/k norm over the whole projection, clip_qkv, top-k not renormalised
        cls, kwargs = tf.OlmoeConfig, dict(num_experts_per_tok=2, intermediate_size=32, num_hidden_layers=2,
                                           num_experts=8, clip_qkv=1.5, norm_topk_prob=False)
    elif arch == "granitemoe":  # the four multipliers; experts stored stacked (input_linear / output_linear)
        cls, kwargs = tf.GraniteMoeConfig, dict(num_experts_per_tok=2, intermediate_size=32, num_hidden_layers=2,
                                                num_local_experts=8, embedding_multiplier=6.0,
                                                attention_multiplier=0.2, residual_multiplier=0.4,
                                                logits_scaling=3.0)
    elif arch == "phi3":       # qkv_proj and gate_up_proj fused in the checkpoint
        cls, kwargs = tf.Phi3Config, dict(intermediate_size=128, num_hidden_layers=2, pad_token_id=0)
    elif arch == "granite":    # the four multipliers
        cls, kwargs = tf.GraniteConfig, dict(intermediate_size=128, num_hidden_layers=2, embedding_multiplier=6.0,
                                             attention_multiplier=0.2, residual_multiplier=0.4, logits_scaling=3.0)
    elif arch == "mistral_window":  # every layer windowed (W 10, not a multiple of a block): blocks released
        cls, kwargs = tf.MistralConfig, dict(intermediate_size=128, num_hidden_layers=2, sliding_window=10)
    elif arch == "mistral_sliding":  # every layer windowed (12: below a block of 16, not a multiple of 8)
        cls, kwargs = tf.MistralConfig, dict(intermediate_size=128, num_hidden_layers=2, sliding_window=12)
    elif arch == "qwen2_sliding":    # layer 0 full attention, layers 1-2 windowed (max_window_layers); qkv bias
        cls, kwargs = tf.Qwen2Config, dict(intermediate_size=128, num_hidden_layers=3, use_sliding_window=True,
                                           sliding_window=10, max_window_layers=1)
    elif arch in ("gemma2", "gemma3", "gemma3_mm"):
        return _tiny_gemma(arch, common, overrides)
    elif arch.startswith("deepseek"):
        return _tiny_deepseek(arch, common | overrides)
    else:
        raise ValueError(arch)
    return cls(**(common | kwargs | overrides))


def _tiny_gemma(arch: str, common: dict, overrides: dict):
    """Gemma 2 (sliding and global layers alternating, both soft caps) and Gemma 3 (sliding layers with their own
    RoPE base, one global layer with linear RoPE scaling); window 12, query_pre_attn_scalar != head_dim, tied
    embeddings. gemma3_mm: the multimodal checkpoint, Gemma 3 text beside a tiny vision tower."""
    import transformers as tf

    gemma = dict(common, tie_word_embeddings=True, intermediate_size=96, head_dim=32, sliding_window=12,
                 query_pre_attn_scalar=24, pad_token_id=0)
    if arch == "gemma2":
        return tf.Gemma2Config(**(gemma | dict(num_hidden_layers=4, attn_logit_softcapping=20.0,
                                               final_logit_softcapping=15.0) | overrides))
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**(gemma | dict(num_hidden_layers=5, sliding_window_pattern=3,
                                                   rope_local_base_freq=500.0, rope_theta=20000.0,
                                                   rope_scaling={"rope_type": "linear", "factor": 4.0},
                                                   final_logit_softcapping=25.0) | overrides))
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=28, patch_size=14)
    return tf.Gemma3Config(text_config=tiny_config("gemma3", **overrides).to_dict(), vision_config=vision.to_dict(),
                           mm_tokens_per_image=4, boi_token_index=60000, eoi_token_index=60001,
                           image_token_index=60002, eos_token_id=[2, 106])


def _tiny_deepseek(arch: str, common: dict):
    """DeepSeek-V2 (q_proj, group-limited greedy routing over softmax, yarn RoPE with mscale) and -V3 (q LoRA,
    noaux_tc: sigmoid + correction bias, renormalised, top-2-sum group scores); layer 0 dense, a shared expert,
    routed_scaling_factor != 1, MLA with kv_lora_rank 32."""
    import transformers as tf

    mla = dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
               qk_nope_head_dim=16, v_head_dim=16)
    common = {**common, "num_key_value_heads": None}
    if arch == "deepseek_v2":
        return tf.DeepseekV2Config(**common, **mla, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                   routed_scaling_factor=1.5, q_lora_rank=None, qk_rope_head_dim=8,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": 256, "mscale": 1.0,
                                                    "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(**common, **mla, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                   q_lora_rank=24, qk_rope_head_dim=16, norm_topk_prob=True)
    # Other shapes: 3 heads, v_head_dim != qk_nope_head_dim, 6 experts, k=3, attention biases
    other = dict(num_attention_heads=3, num_key_value_heads=3, hidden_size=48, num_hidden_layers=2,
                 intermediate_size=40, moe_intermediate_size=24, n_routed_experts=6, num_experts_per_tok=3,
                 kv_lora_rank=20, qk_nope_head_dim=12, v_head_dim=10, attention_bias=True)
    common = {**common, **other}
    if arch == "deepseek_v2_greedy":  # plain softmax top-k, q LoRA, two shared experts' width, scaling < 1
        return tf.DeepseekV2Config(**common, topk_method="greedy", q_lora_rank=16, qk_rope_head_dim=4,
                                   n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=0.7)
    if arch == "deepseek_v3_rotate_half":  # rope_interleave False, yarn with mscale != mscale_all_dim (RoPE
        # tables scaled too), tied embeddings, every layer sparse, no shared expert (zero-width tensors saved)
        return tf.DeepseekV3Config(**{**common, "tie_word_embeddings": True}, rope_interleave=False,
                                   q_lora_rank=None, qk_rope_head_dim=6, n_group=3, topk_group=2,
                                   first_k_dense_replace=0, n_shared_experts=0, norm_topk_prob=False,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0,
                                                    "original_max_position_embeddings": 64, "mscale": 0.707,
                                                    "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    raise ValueError(arch)


def make_checkpoint(path: str, arch: str, seed: int = 0, stacked_experts: bool = False,
                    state_dict_names: bool = False, **overrides):
    """Write a tiny random checkpoint + the SmolLM2 tokenizer to `path`; returns transformers' model (eager
    attention and experts), the oracle. stacked_experts: the experts saved as transformers holds them
    (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`) rather than one tensor per expert.
    state_dict_names: every tensor saved under its name in transformers' state_dict, not the name save_pretrained
    converts it to (a multimodal model's `model.language_model.*`, not `language_model.model.*`).
    overrides: tiny_config's."""
    import transformers as tf
    from safetensors.torch import save_file

    from tests.helpers.checkpoints import builtin_tokenizer

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # far from ties; 1-D weights (norms around 1, biases around 0) randomised too
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.uniform_(0.6, 1.4)
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias, large enough to change choices
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    model.save_pretrained(path)
    if stacked_experts or state_dict_names:
        os.remove(os.path.join(path, "model.safetensors"))
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()  # stored once, as the embedding
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in tied},
                  os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    builtin_tokenizer().save_pretrained(path)
    return model



def checkpoint_tensor_names(path: str) -> set[str]:
    """The tensor names of the checkpoint in folder `path` (one model.safetensors)."""
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def assert_every_tensor_consumed(engine, path: str, stacked: bool = False) -> None:
    """The checkpoint's tensor names are exactly those the model loads (none left over, none missing); experts
    one tensor each, or stacked (Granite-MoE's, or transformers' own 3-D tensors)."""
    from kvserve.model_loader.weight_loader import expected_tensors

    model = engine.core.executor.worker.runner.model
    needed = {name for name, t in expected_tensors(model).items() if not t.expert or t.stacked == stacked}
    assert checkpoint_tensor_names(path) == needed


@torch.inference_mode()
def chosen_experts(engine, hf, tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sparse layer, the experts (sorted, [T, k]) each prompt token picks: ours (one paged forward through
    `engine`), then transformers' (`hf`: each architecture's TopKRouter / TopkRouter returns (logits, weights,
    expert ids))."""
    from kvserve.layers.moe_router import select_experts
    from tests.helpers.oracles import hf_logits, paged_logits

    ours, theirs, hooks, wrapped = [], [], [], []
    for layer in engine.core.executor.worker.runner.model.layers:
        if not hasattr(layer.mlp, "experts"):
            continue
        gate = layer.mlp.gate
        # NOTE: our model calls forward/select, not __call__ (no hooks): they are wrapped instead
        if hasattr(gate, "select"):  # a router that selects itself (DeepSeek's grouped top-k)
            def select(logits, inner=gate.select):
                weights, ids = inner(logits)
                ours.append(ids.sort(-1).values)
                return weights, ids
            gate.select, name = select, "select"
        else:  # softmax top-k of the router logits
            def forward(x, inner=gate.forward, k=layer.mlp.experts.top_k):
                logits = inner(x)
                ours.append(select_experts(logits, k, False)[1].sort(-1).values)
                return logits
            gate.forward, name = forward, "forward"
        wrapped.append((gate, name))
    for module in hf.modules():
        if type(module).__name__.lower().endswith("topkrouter"):
            hooks.append(module.register_forward_hook(lambda m, i, out: theirs.append(out[2].sort(-1).values)))
    try:
        paged_logits(engine, [(tokens, 0, len(tokens))])
        hf_logits(hf, tokens)
    finally:
        for h in hooks:
            h.remove()
        for gate, name in wrapped:
            delattr(gate, name)
    return ours, theirs
