"""DeepSeek-V2 / DeepSeek-V3 (MLA over a latent KV cache, grouped top-k MoE) against transformers eager on tiny
random-weight checkpoints written by transformers' own config classes (tests/helpers/architectures.py): V2 with
q_proj, group-limited greedy routing and yarn RoPE (mscale); V3 with q LoRA, noaux_tc routing whose correction
bias (randomised, large) changes choices, renormalised; both with layer 0 dense, a shared expert and
routed_scaling_factor != 1, every 1-D weight randomised.

Compared: the experts each token picks (before the logits), the logits of a mixed batch through the latent
cache (absorbed decodes, decompressed prefill chunks over gathered context), greedy tokens through chunked
prefill, a prefix-cache hit on the latent cache, preemption and n-gram speculation, block invariants after
every step; the cache's size (one latent vector per token and layer) and what MLA refuses. Tensor parallelism:
tests/e2e/test_deepseek_tp.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.model_loader.weight_loader import expected_tensors
from kvserve.sampling_params import SamplingParams
from tests.helpers.architectures import chosen_experts, make_checkpoint
from tests.helpers.engine import run_last_after_prefix, run_to_completion
from tests.helpers.oracles import assert_logits_match_hf, hf_greedy, hf_logits, mixed_batch, paged_logits

ARCHS = ("deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    """(arch, path, transformers model), written once per module."""
    path = str(tmp_path_factory.mktemp(request.param))
    return request.param, path, make_checkpoint(path, request.param)


def _engine(path: str, **kwargs) -> Engine:
    return Engine(EngineArgs(model=path, **{"num_gpu_blocks_override": 64, **kwargs}))


def _model(engine: Engine):
    return engine.core.executor.worker.runner.model


def test_every_checkpoint_tensor_is_consumed(checkpoint):
    from safetensors import safe_open

    arch, path, _ = checkpoint
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    expected = expected_tensors(_model(_engine(path)))
    stacked = "model.layers.1.mlp.experts.gate_up_proj" in names
    assert names == {n for n, t in expected.items() if not t.expert or t.stacked == stacked}
    q = {"deepseek_v2": "q_proj", "deepseek_v3": "q_a_proj"}[arch]
    for name in (f"model.layers.0.self_attn.{q}.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                 "model.layers.0.self_attn.kv_a_layernorm.weight", "model.layers.0.self_attn.kv_b_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.shared_experts.down_proj.weight"):
        assert name in names
    assert ("model.layers.2.mlp.gate.e_score_correction_bias" in names) == (arch == "deepseek_v3")


def test_multi_token_prediction_layers_are_skipped(tmp_path):
    """A V3 checkpoint with its MTP layer (model.layers.{num_hidden_layers}.*, as DeepSeek ships it) loads, the
    extra layer unused; a stray tensor of a real layer is still an error."""
    from safetensors.torch import load_file, save_file

    hf = make_checkpoint(str(tmp_path), "deepseek_v3", seed=5)
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(file)
    n = hf.config.num_hidden_layers
    save_file({**tensors, f"model.layers.{n}.eh_proj.weight": torch.zeros(4, 4)}, file, metadata={"format": "pt"})
    assert_logits_match_hf(_engine(str(tmp_path)), hf, mixed_batch(seed=6)[:2], atol=1e-4, rtol=1e-4)
    save_file({**tensors, "model.layers.0.eh_proj.weight": torch.zeros(4, 4)}, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensors in checkpoint: model.layers.0.eh_proj.weight"):
        _engine(str(tmp_path))


def test_latent_kv_cache_holds_one_vector_per_token_and_layer(checkpoint):
    """bytes/token = layers x (kv_lora_rank + qk_rope_head_dim) x 4 (float32), not 2 x layers x heads x dims."""
    _, path, hf = checkpoint
    cfg = hf.config
    engine = _engine(path)
    runner = engine.core.executor.worker.runner
    spec = runner.spec
    assert spec.latent and spec.num_kv_heads == 1
    assert spec.bytes_per_token == cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert runner.kv_caches[0].shape == (64, spec.block_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert engine.core.executor.worker.backend.name == "mla"


def test_logits_and_chosen_experts_match_transformers(checkpoint):
    arch, path, hf = checkpoint
    engine = _engine(path)
    batch = mixed_batch(seed=sum(map(ord, arch)))
    ours, theirs = chosen_experts(engine, hf, batch[0][0])
    assert len(ours) == len(theirs) == 2  # layers 1 and 2 sparse, layer 0 dense
    for got, want in zip(ours, theirs):
        assert torch.equal(got, want)
    assert_logits_match_hf(engine, hf, batch, atol=1e-4, rtol=1e-4)
    assert engine.block_pool.counts()["in_use"] == 0


@pytest.mark.parametrize("arch", ["deepseek_v2_greedy", "deepseek_v3_rotate_half"])
def test_other_shapes_and_options_match_transformers(tmp_path, arch):
    hf = make_checkpoint(str(tmp_path), arch, seed=7)
    engine = _engine(str(tmp_path))
    batch = mixed_batch(seed=8)
    ours, theirs = chosen_experts(engine, hf, batch[0][0])
    assert len(ours) == len(theirs) == (1 if arch == "deepseek_v2_greedy" else 2)
    for got, want in zip(ours, theirs):
        assert torch.equal(got, want)
    assert_logits_match_hf(engine, hf, batch, atol=1e-4, rtol=1e-4)


def test_correction_bias_changes_the_choice(checkpoint):
    """V3's randomised e_score_correction_bias moves some token's experts: without it the choice differs."""
    arch, path, _ = checkpoint
    if arch != "deepseek_v3":
        pytest.skip("V3 routing only")
    engine = _engine(path)
    gate = _model(engine).layers[1].mlp.gate
    x = torch.randn(64, gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = gate.forward(x)
        with_bias = gate.select(logits)[1].sort(-1).values
        bias = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.zero_()
        without = gate.select(logits)[1].sort(-1).values
        gate.e_score_correction_bias.copy_(bias)
    assert not torch.equal(with_bias, without)


def _prompts(n_shared: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 49152, (n_shared,), generator=g).tolist()
    return [prefix + torch.randint(0, 49152, (n,), generator=g).tolist() for n in (3, 11, 7)]


@pytest.mark.parametrize("moe_impl", ["sorted", "reference"])
def test_greedy_tokens_with_chunked_prefill_and_prefix_hit(checkpoint, moe_impl, monkeypatch):
    """Three prompts sharing a 40-token prefix, in 16-token chunks (later chunks read their context from the
    latent cache), the last after the others finish (a prefix-cache hit on latent blocks)."""
    _, path, hf = checkpoint
    monkeypatch.setenv("KVSERVE_MOE_IMPL", moe_impl)
    engine = _engine(path, max_num_batched_tokens=16, enable_chunked_prefill=True)
    prompts = _prompts()
    done = run_last_after_prefix(engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert done[str(len(prompts) - 1)].num_cached_tokens >= 32
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(hf, prompt, 8)[0], f"request {i}"


def test_preemption_recomputes_the_latent_cache(checkpoint):
    """Eight requests in a pool of 10 blocks of 16: some are preempted and recomputed; tokens unchanged."""
    _, path, hf = checkpoint
    engine = _engine(path, num_gpu_blocks_override=10, max_num_batched_tokens=32)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (20, 35, 9, 28, 17, 40, 12, 25)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    done = run_to_completion(engine)
    assert engine.scheduler.stats.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(hf, prompt, 12)[0], f"request {i}"


def test_ngram_speculation_verifies_drafts_through_mla(checkpoint):
    """Several query rows of one request verified in one pass (each an absorbed decode): tokens unchanged."""
    _, path, hf = checkpoint
    engine = _engine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_min": 1, "prompt_lookup_max": 2, "adaptive": False})
    prompt = [1, 2, 3] * 8  # both tiny models' greedy tokens repeat after it: the lookup proposes drafts
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    done = run_to_completion(engine)
    assert engine.scheduler.stats.num_spec_drafts > 0
    assert done["0"].outputs[0].token_ids == hf_greedy(hf, prompt, 24)[0]


def test_attention_backend_flag_does_not_change_mla(checkpoint):
    """--attention-backend cpu_paged: the MLA layers still attend through their own op; same logits."""
    _, path, hf = checkpoint
    engine = _engine(path, attention_backend="cpu_paged")
    assert engine.core.executor.worker.backend.name == "mla"
    assert_logits_match_hf(engine, hf, mixed_batch(seed=3)[:3], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(kv_cache_dtype="int8"), "latent KV cache is not quantized"),
    (dict(enable_lora=True), "LoRA adapters on an MLA"),
])
def test_what_mla_refuses_is_named(checkpoint, kwargs, message):
    _, path, _ = checkpoint
    with pytest.raises(ValueError, match=message):
        _engine(path, **kwargs)


def test_draft_model_beside_or_as_mla_is_refused(checkpoint):
    _, path, _ = checkpoint
    with pytest.raises(ValueError, match="draft model"):
        _engine(path, speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})


def test_dummy_weights_serve(checkpoint):
    """--load-format dummy (benchmarks without a checkpoint): every parameter filled, the latent path runs."""
    _, path, _ = checkpoint
    engine = _engine(path, load_format="dummy")
    engine.add_request("0", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(run_to_completion(engine)["0"].outputs[0].token_ids) == 4


def test_int8_quantizes_the_projections_but_not_kv_b(checkpoint):
    """--quantization int8: the q/kv-latent/o projections and MLPs are int8; kv_b_proj stays dense (the absorbed
    decode reads its weight as W_UK / W_UV); the logits point where transformers' do (int8 rounding: not equal)."""
    _, path, hf = checkpoint
    engine = _engine(path, quantization="int8", quantization_group_size=-1)  # V3 q_lora_rank 24: per channel
    attn = _model(engine).layers[0].self_attn
    assert attn.kv_b_proj.method.name == "dense"
    assert attn.kv_a_proj_with_mqa.method.name == attn.o_proj.method.name == "int8"
    batch = mixed_batch(seed=9)[2:5]  # decodes and a one-token prompt
    for (tokens, ctx, q), got in zip(batch, paged_logits(engine, batch)):
        ref = hf_logits(hf, tokens[:ctx + q])[ctx:ctx + q]
        assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() > 0.99


def test_bf16_model_keeps_its_routers_float32(checkpoint):
    """bfloat16 weights and latent cache; the routers' weights stay float32, as transformers keeps them (a bf16
    router flips near-tied experts; so do transformers' own bf16 and fp32 models against each other, which is why
    no bf16 logits are compared here)."""
    _, path, _ = checkpoint
    engine = _engine(path, dtype="bfloat16")
    model = _model(engine)
    assert model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    assert engine.core.executor.worker.runner.kv_caches[0].dtype == torch.bfloat16
    for got in paged_logits(engine, mixed_batch(seed=4)[:4]):
        assert torch.isfinite(got).all()
