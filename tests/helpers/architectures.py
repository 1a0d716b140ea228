"""Tiny random-weight checkpoints of the architectures beyond the Llama family (MoE, Phi-3, Granite, Gemma 2/3)
and of sliding-window ones (Mistral, Qwen2 with windowed layers), built with transformers' own config classes:
every weight randomised, 1-D ones included."""
from __future__ import annotations

import os

import torch


def tiny_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=49152, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  rms_norm_eps=1e-5)
    moe = dict(num_experts_per_tok=2, intermediate_size=96)
    if arch == "qwen3_moe":  # layer 1 dense (mlp_only_layers), per-head q/k norm, renormalised top-k
        return tf.Qwen3MoeConfig(**common, **moe, num_hidden_layers=3, head_dim=32, num_experts=8,
                                 moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True)
    if arch == "mixtral":    # every layer sparse, experts named w1/w3/w2 under block_sparse_moe
        return tf.MixtralConfig(**common, num_experts_per_tok=2, intermediate_size=48, num_hidden_layers=2,
                                num_local_experts=8, sliding_window=None)
    if arch == "qwen2_moe":  # layers 1 and 3 sparse (decoder_sparse_step 2), a gated shared expert, qkv bias
        return tf.Qwen2MoeConfig(**common, **moe, num_hidden_layers=4, num_experts=8, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, decoder_sparse_step=2, norm_topk_prob=False)
    if arch == "olmoe":      # q/k norm over the whole projection, clip_qkv, top-k not renormalised
        return tf.OlmoeConfig(**common, num_experts_per_tok=2, intermediate_size=32, num_hidden_layers=2,
                              num_experts=8, clip_qkv=1.5, norm_topk_prob=False)
    if arch == "granitemoe":  # the four multipliers; experts stored stacked (input_linear / output_linear)
        return tf.GraniteMoeConfig(**common, num_experts_per_tok=2, intermediate_size=32, num_hidden_layers=2,
                                   num_local_experts=8, embedding_multiplier=6.0, attention_multiplier=0.2,
                                   residual_multiplier=0.4, logits_scaling=3.0)
    if arch == "phi3":       # qkv_proj and gate_up_proj fused in the checkpoint
        return tf.Phi3Config(**common, intermediate_size=128, num_hidden_layers=2, pad_token_id=0)
    if arch == "mistral_window":  # every layer windowed (W 10, not a multiple of a block): blocks released
        return tf.MistralConfig(**common, intermediate_size=128, num_hidden_layers=2, sliding_window=10)
    if arch == "granite":    # the four multipliers
        return tf.GraniteConfig(**common, intermediate_size=128, num_hidden_layers=2, embedding_multiplier=6.0,
                                attention_multiplier=0.2, residual_multiplier=0.4, logits_scaling=3.0)
    if arch == "mistral_sliding":  # every layer windowed (12: below a block of 16, not a multiple of 8)
        return tf.MistralConfig(**common, intermediate_size=128, num_hidden_layers=2, sliding_window=12)
    if arch == "qwen2_sliding":    # layer 0 full attention, layers 1-2 windowed (max_window_layers); qkv bias
        return tf.Qwen2Config(**common, intermediate_size=128, num_hidden_layers=3, use_sliding_window=True,
                              sliding_window=10, max_window_layers=1)
    gemma = dict(common, tie_word_embeddings=True, intermediate_size=96, head_dim=32, sliding_window=12,
                 query_pre_attn_scalar=24, pad_token_id=0)
    if arch == "gemma2":     # sliding and global layers alternating, both soft caps
        return tf.Gemma2Config(**gemma, num_hidden_layers=4, attn_logit_softcapping=20.0,
                               final_logit_softcapping=15.0)
    if arch == "gemma3":     # sliding layers with their own RoPE base, one global layer with linear RoPE scaling
        return tf.Gemma3TextConfig(**gemma, num_hidden_layers=5, sliding_window_pattern=3, rope_local_base_freq=500.0,
                                   rope_theta=20000.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                                   final_logit_softcapping=25.0)
    if arch == "gemma3_mm":  # the multimodal checkpoint: Gemma 3 text (as above) beside a tiny vision tower
        vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=28, patch_size=14)
        return tf.Gemma3Config(text_config=tiny_config("gemma3").to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                               boi_token_index=60000, eoi_token_index=60001, image_token_index=60002,
                               eos_token_id=[2, 106])
    raise ValueError(arch)


def make_checkpoint(path: str, arch: str, seed: int = 0, stacked_experts: bool = False,
                    state_dict_names: bool = False):
    """Write a tiny random checkpoint + the SmolLM2 tokenizer to `path`; returns transformers' model (eager
    attention and experts), the oracle. stacked_experts: the experts saved as transformers holds them
    (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`) rather than one tensor per expert.
    state_dict_names: every tensor saved under its name in transformers' state_dict, not the name save_pretrained
    converts it to (a multimodal model's `model.language_model.*`, not `language_model.model.*`)."""
    import transformers as tf
    from safetensors.torch import save_file

    from tests.helpers.checkpoints import builtin_tokenizer

    torch.manual_seed(seed)
    cfg = tiny_config(arch)
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
    model.save_pretrained(path)
    if stacked_experts or state_dict_names:
        os.remove(os.path.join(path, "model.safetensors"))
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()  # stored once, as the embedding
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in tied},
                  os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    builtin_tokenizer().save_pretrained(path)
    return model
