"""GGUF `gemma2`, `gemma3` and `deepseek2` files read back as transformers' Gemma 2 / Gemma 3 text / DeepSeek-V2 and
V3 checkpoints: the config from the metadata and every tensor under its HF name (norms' +1 removed, DeepSeek's
split k_b/v_b joined into kv_b_proj, experts stacked as transformers holds them), then the engine serving the
file alone against transformers' logits on a mixed batch; tiny random transformers models written as
llama.cpp's converter writes them (tests/helpers/gguf_convert.py).
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.model_loader.gguf_loader import iter_gguf_tensors, load_gguf_config
from tests.helpers.gguf_convert import write_gguf
from tests.helpers.oracles import hf_logits, mixed_batch, paged_logits

_COMMON = dict(vocab_size=49152, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
               max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _random(config):
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for t in model.state_dict().values():
            t.normal_(0, 0.08) if t.dim() >= 2 else t.uniform_(-0.4, 0.4)
    return model


def _assert_tensors_match(path: str, model) -> None:
    ours = dict(iter_gguf_tensors(path))
    want = {k: v for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    assert set(ours) == set(want)
    for name, tensor in want.items():
        # NOTE: the file holds 1 + w for a Gemma norm: w comes back within a float32 rounding of 1
        torch.testing.assert_close(ours[name], tensor, atol=1e-7 if "norm" in name else 0, rtol=0, msg=name)


def _assert_engine_matches(path: str, model) -> None:
    engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=64))
    batch = mixed_batch(seed=3)
    for (tokens, ctx, q), got in zip(batch, paged_logits(engine, batch)):
        torch.testing.assert_close(got, hf_logits(model, tokens[:ctx + q])[ctx:ctx + q], atol=1e-4, rtol=1e-4)
    engine.scheduler.check_invariants()


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_gemma_files(tmp_path, model_type):
    cls = tf.Gemma2Config if model_type == "gemma2" else tf.Gemma3TextConfig
    extra = dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "default", "rope_theta": 1e6}}) \
        if model_type == "gemma3_text" else dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    # llama.cpp scales queries by 1/sqrt(head_dim) but in the 27B models: so does this config
    config = cls(**(_COMMON | dict(num_hidden_layers=7 if model_type == "gemma3_text" else 4)), head_dim=32,
                 intermediate_size=96, sliding_window=16, query_pre_attn_scalar=32, **extra)
    model = _random(config)
    path = str(tmp_path / f"{model_type}.gguf")
    write_gguf(path, model, model_type)
    got = load_gguf_config(path)
    assert got.architectures == ["Gemma2ForCausalLM" if model_type == "gemma2" else "Gemma3ForCausalLM"]
    for field in ("layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim", "num_key_value_heads",
                  "intermediate_size", "tie_word_embeddings", "attn_logit_softcapping", "final_logit_softcapping",
                  "hidden_activation", "rope_parameters"):
        assert getattr(got, field) == getattr(config, field), field
    _assert_tensors_match(path, model)
    _assert_engine_matches(path, model)


@pytest.mark.parametrize(("version", "split_kv_b"), [("v3", True), ("v3", False), ("v2", True)])
def test_deepseek2_files(tmp_path, version, split_kv_b):
    mla = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32,
               n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, intermediate_size=96)
    if version == "v3":
        config = tf.DeepseekV3Config(**(_COMMON | dict(num_key_value_heads=4)), **mla, q_lora_rank=48,
                                     n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                     norm_topk_prob=True)
    else:
        config = tf.DeepseekV2Config(**(_COMMON | dict(num_key_value_heads=4)), **mla, q_lora_rank=None,
                                     n_shared_experts=2, norm_topk_prob=False)
    model = _random(config)
    path = str(tmp_path / f"ds-{version}.gguf")
    write_gguf(path, model, config.model_type, split_kv_b=split_kv_b)
    got = load_gguf_config(path)
    assert got.model_type == config.model_type
    assert got.architectures == [f"DeepseekV{version[1]}ForCausalLM"]
    for field in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                  "num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob",
                  "intermediate_size"):
        assert getattr(got, field) == getattr(config, field), field
    if version == "v3":
        assert (got.n_group, got.topk_group) == (2, 1)
    _assert_tensors_match(path, model)
    _assert_engine_matches(path, model)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "phi3", "gemma2", "gemma3_text"])
def test_the_test_converter_writes_what_transformers_reads(tmp_path, model_type):
    """The oracle's own check: transformers' GGUF reader (which knows these architectures) finds in the files
    tests/helpers/gguf_convert.py writes exactly the weights of the model written, so the conventions the
    loader tests assume (stacked experts, Gemma's +1 norms, fused Phi-3 tensors) are llama.cpp's as transformers
    reads them too. (Dense layers of a Qwen MoE model have no llama.cpp name: transformers maps none.)"""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tests.helpers.architectures import make_checkpoint
    from tests.helpers.gguf import hf_gguf_config

    if model_type.startswith("gemma"):
        cls = tf.Gemma2Config if model_type == "gemma2" else tf.Gemma3TextConfig
        model = _random(cls(**_COMMON, head_dim=32, intermediate_size=96, sliding_window=16,
                            query_pre_attn_scalar=32))
    else:
        model = make_checkpoint(str(tmp_path / "hf"), model_type)
    path = str(tmp_path / f"{model_type}.gguf")
    write_gguf(path, model, model_type)
    with torch.device("meta"):
        skeleton = tf.AutoModelForCausalLM.from_config(hf_gguf_config(path))
    theirs = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton,
                                  torch_dtype=torch.float32)["tensors"]
    want = model.state_dict()
    unmapped = {k for k in want if k not in theirs}
    assert all(".mlp.gate_proj." in k or ".mlp.up_proj." in k or ".mlp.down_proj." in k or k == "lm_head.weight"
               for k in unmapped), sorted(unmapped)
    for name in want.keys() - unmapped:
        torch.testing.assert_close(theirs[name], want[name], atol=1e-6, rtol=0, msg=name)
