"""Tiny random-weight checkpoints written by `transformers`, loaded through our real loader.

They use the built-in model's tokenizer (SmolLM2, 49,152 tokens) so text paths are realistic; the weights
are random and tiny, so a golden run costs milliseconds per step. The session fixtures that hand them out
live in tests/conftest.py.
"""
from __future__ import annotations

import functools

import torch

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(arch: str, tie: bool):
    import transformers as tf

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    if arch == "llama":
        return tf.LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 256})
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32)
    raise ValueError(arch)


@functools.lru_cache(maxsize=1)
def builtin_tokenizer():
    """The built-in model's tokenizer, read from its GGUF file once a process (seconds each time otherwise).
    Shared: do not change it."""
    from kvserve.model_loader.gguf_loader import builtin_model_path, load_gguf_tokenizer

    return load_gguf_tokenizer(builtin_model_path())


def make_tiny_checkpoint(path: str, arch: str = "llama", tie: bool = False, seed: int = 0):
    """Write a random tiny checkpoint + the SmolLM2 tokenizer to `path`; returns the HF model (oracle)."""
    return write_random_checkpoint(path, tiny_config(arch, tie), seed)


def write_random_checkpoint(path: str, cfg, seed: int = 0):
    """A random model of transformers config `cfg` + the SmolLM2 tokenizer written to `path`; returns the model."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random init is small; widen it so logits are far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    builtin_tokenizer().save_pretrained(path)
    return model
