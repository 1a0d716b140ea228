"""Logits of our paged forward pass vs Hugging Face transformers on the same weights.

Covers every supported architecture (tiny random checkpoints written by transformers) and the built-in
SmolLM2 GGUF (vs transformers loading the same GGUF), in mixed batches: fresh prefills, prefill chunks
with cached context, and decodes, all in one forward pass through block tables.
"""
from __future__ import annotations

import os

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from tests.helpers.checkpoints import TINY_ARCHS, builtin_tokenizer, make_tiny_checkpoint
from tests.helpers.engine import ATTENTION_BACKENDS
from tests.helpers.oracles import assert_logits_match_hf, mixed_batch


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("tie", [False, True])
def test_tiny_checkpoint_logits_match_transformers(tiny_checkpoint, arch, tie, backend):
    path, hf = tiny_checkpoint(arch, tie)
    engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=64, attention_backend=backend))
    assert_logits_match_hf(engine, hf, mixed_batch(seed=hash((arch, tie)) % 1000), atol=1e-4, rtol=1e-4)
    assert engine.block_pool.counts()["in_use"] == 0


def test_unsupported_architecture_lists_supported(tmp_path):
    import transformers as tf

    tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        Engine(EngineArgs(model=str(tmp_path)))


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_tiny_checkpoint(str(tmp_path), "llama")
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(file)
    broken = dict(tensors)
    del broken["model.layers.1.mlp.up_proj.weight"]
    save_file(broken, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        Engine(EngineArgs(model=str(tmp_path)))
    broken = dict(tensors)
    broken["model.norm.weight"] = torch.ones(65)
    save_file(broken, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(65,\), expected \(64,\)"):
        Engine(EngineArgs(model=str(tmp_path)))
    broken = dict(tensors)
    broken["model.layers.0.extra.weight"] = torch.ones(3)
    save_file(broken, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensors in checkpoint: model\.layers\.0\.extra\.weight"):
        Engine(EngineArgs(model=str(tmp_path)))


def test_head_dim_64_logits_match_transformers(tmp_path):
    """A head_dim the attention kernel is compiled for (64, as SmolLM2's): its tiles of many query rows (fresh
    prefills, chunks after cached context, a 5-token run as a request verifying drafts) take the vector-lanes
    path, decodes the dot-product one; the tiny checkpoints above (head_dim 16) take the generic path."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)  # GQA groups of 3, as SmolLM2's
    hf = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # as make_tiny_checkpoint: logits far from ties
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    hf.save_pretrained(str(tmp_path))
    builtin_tokenizer().save_pretrained(str(tmp_path))
    engine = Engine(EngineArgs(model=str(tmp_path), num_gpu_blocks_override=64, attention_backend="cpu_paged"))
    g = torch.Generator().manual_seed(7)
    batch = mixed_batch(seed=5) + [(torch.randint(0, 49152, (70,), generator=g).tolist(), 65, 5)]
    assert_logits_match_hf(engine, hf, batch, atol=1e-4, rtol=1e-4)
    assert engine.block_pool.counts()["in_use"] == 0
