"""Config fields of well-known models, so that `kvserve kv-calc --model NAME` sizes them without a download.

Only fields of each model's published config.json (the text model's, for Gemma 3) are written here, never a
result: kv-calc computes every figure from them as it does from a file.
"""
from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3": dict(  # deepseek-ai/DeepSeek-V3: MLA (512 + 64 latent), 256 routed experts + 1 shared
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], dtype="bfloat16", vocab_size=129280,
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
        num_experts_per_tok=8, first_k_dense_replace=3, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840,
        tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(  # Qwen/Qwen3-30B-A3B: 128 experts, 8 a token, GQA 32/4
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], dtype="bfloat16", vocab_size=151936,
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, use_sliding_window=False,
        sliding_window=None, tie_word_embeddings=False),
    "gemma-3-27b": dict(  # google/gemma-3-27b-it's text model: 1024-token windows, every 6th layer global
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], dtype="bfloat16", vocab_size=262208,
        hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
        num_key_value_heads=16, head_dim=128, sliding_window=1024, sliding_window_pattern=6,
        max_position_embeddings=131072, tie_word_embeddings=True),
    "mixtral-8x7b": dict(  # mistralai/Mixtral-8x7B-v0.1: 8 experts, 2 a token, no window
        model_type="mixtral", architectures=["MixtralForCausalLM"], dtype="bfloat16", vocab_size=32000,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
        sliding_window=None, tie_word_embeddings=False),
    "mistral-7b-v0.1": dict(  # mistralai/Mistral-7B-v0.1: a 4096-token window on every layer
        model_type="mistral", architectures=["MistralForCausalLM"], dtype="bfloat16", vocab_size=32000,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, sliding_window=4096, max_position_embeddings=32768, tie_word_embeddings=False),
    "llama-3-70b": dict(  # meta-llama/Meta-Llama-3-70B: GQA 64/8
        model_type="llama", architectures=["LlamaForCausalLM"], dtype="bfloat16", vocab_size=128256,
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False),
}


def preset(name: str) -> dict[str, Any] | None:
    """A copy of the preset config `name` (case-insensitive), or None."""
    fields = PRESETS.get(name.lower())
    return None if fields is None else dict(fields)
