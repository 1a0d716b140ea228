"""Tiny random-weight checkpoints of the architectures beyond the Llama family (MoE, Phi-3, Granite) and of
sliding-window ones (Mistral, Qwen2 with windowed layers), built with transformers' own config classes: every
weight randomised, 1-D ones included."""
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
    else:
        raise ValueError(arch)
    return cls(**(common | kwargs | overrides))


def make_checkpoint(path: str, arch: str, seed: int = 0, stacked_experts: bool = False, **overrides):
    """Write a tiny random checkpoint + the SmolLM2 tokenizer to `path`; returns transformers' model (eager
    attention and experts), the oracle. stacked_experts: the experts saved as transformers holds them
    (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`) rather than one tensor per expert.
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
    model.save_pretrained(path)
    if stacked_experts:
        os.remove(os.path.join(path, "model.safetensors"))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
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
    """Per sparse layer, the experts (sorted, [T, k]) each prompt token picks: ours (FusedMoE's routing of our
    router's logits), then transformers' (its TopKRouter's output), over one prefill of `tokens`."""
    from kvserve.layers.moe import select_experts
    from tests.helpers.oracles import hf_logits, paged_logits

    ours, theirs, hooks = [], [], []
    blocks = [layer.mlp for layer in engine.core.executor.worker.runner.model.layers if hasattr(layer.mlp, "experts")]
    for block in blocks:
        # NOTE: our model calls forward, not __call__ (no hooks): the router's forward is wrapped instead
        def recording(x, forward=block.gate.forward, experts=block.experts):
            logits = forward(x)
            ours.append(select_experts(logits, experts.top_k, experts.renormalize)[1].sort(-1).values)
            return logits
        block.gate.forward = recording
    for module in hf.modules():  # each architecture's TopKRouter returns (logits, weights, expert ids)
        if type(module).__name__.endswith("TopKRouter"):
            hooks.append(module.register_forward_hook(lambda m, i, out: theirs.append(out[2].sort(-1).values)))
    try:
        paged_logits(engine, [(tokens, 0, len(tokens))])
        hf_logits(hf, tokens)
    finally:
        for h in hooks:
            h.remove()
        for block in blocks:
            del block.gate.forward
    return ours, theirs
