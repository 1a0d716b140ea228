"""Gemma 2 and Gemma 3 (text) against transformers (eager attention) on tiny random-weight checkpoints written by
transformers' own config classes (tests/helpers/architectures.py).

Each checkpoint mixes sliding-window and global layers (window 12, prompts up to ~4x that), sets
query_pre_attn_scalar apart from head_dim, ties its embeddings and randomises every weight, norms included, so
that (1 + w) is exercised; Gemma 2 soft-caps attention scores and logits, Gemma 3 has q/k norms, a RoPE base of
its own for sliding layers and linear RoPE scaling on its global layer. Compared: the logits of a mixed batch
through the paged cache (also with the fused C++ layer ops), and greedy tokens through the engine with chunked
prefill, a prefix-cache hit, preemption and n-gram speculation, block invariants after every step; a
Gemma3ForConditionalGeneration checkpoint's text part in both of its name layouts; full-size default configs'
tensor names and shapes. Every CPU attention backend (torch_ref with --all-backends).
"""
from __future__ import annotations

import os

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.model_loader.weight_loader import expected_tensors
from kvserve.sampling_params import SamplingParams
from tests.helpers.architectures import make_checkpoint
from tests.helpers.engine import ATTENTION_BACKENDS, run_last_after_prefix, run_to_completion
from tests.helpers.oracles import assert_logits_match_hf, assert_matches_hf, hf_greedy, mixed_batch

GEMMA_ARCHS = ("gemma2", "gemma3")



@pytest.fixture(scope="module", params=GEMMA_ARCHS)
def checkpoint(request, tmp_path_factory):
    """(arch, path, transformers model) for each Gemma, written once per module."""
    path = str(tmp_path_factory.mktemp(request.param))
    return request.param, path, make_checkpoint(path, request.param, seed=7)


def _engine(path: str, attention: str = "torch_ref", **kwargs) -> Engine:
    return Engine(EngineArgs(model=path, attention_backend=attention, **{"num_gpu_blocks_override": 64} | kwargs))


def _prompts(seed: int, lengths: tuple[int, ...], prefix: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 49152, (prefix,), generator=g).tolist()
    return [shared + torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]


def test_every_checkpoint_tensor_is_consumed(checkpoint):
    """Four norms a layer, q/k norms in Gemma 3 only, no lm_head (tied): the names match exactly."""
    from safetensors import safe_open

    arch, path, _ = checkpoint
    model = _engine(path).core.executor.worker.runner.model
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names == set(expected_tensors(model))
    assert "lm_head.weight" not in names and model.lm_head.tied
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (arch == "gemma3")
    assert "model.layers.3.pre_feedforward_layernorm.weight" in names


@pytest.mark.parametrize("config_class", ["Gemma2Config", "Gemma3TextConfig"])
def test_full_size_default_configs_build_transformers_shapes(config_class):
    """transformers' default configs (Gemma 2 2B, a Gemma 3 of the same width), built on the meta device: the
    tensors the loader expects are transformers' own, of the same shapes."""
    import transformers as tf

    from kvserve.attention.torch_ref import TorchRefBackend
    from kvserve.layers.linear_methods import DenseMethod
    from kvserve.model_loader.architectures import resolve_architecture
    from kvserve.model_loader.loader import normalize_config
    from kvserve.models.gemma import GemmaForCausalLM

    cfg = normalize_config(getattr(tf, config_class)())
    with torch.device("meta"):
        hf = tf.AutoModelForCausalLM.from_config(cfg)
        cfg.architectures = [type(hf).__name__]
        ours = GemmaForCausalLM(cfg, resolve_architecture(cfg)[1], TorchRefBackend(), 16, DenseMethod())
    theirs = {k: v.shape for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    assert set(expected_tensors(ours)) == set(theirs)
    assert sum(p.numel() for p in ours.parameters()) == sum(v.numel() for v in theirs.values())


def test_layers_get_their_window_rope_and_soft_cap(checkpoint):
    arch, path, hf = checkpoint
    model = _engine(path).core.executor.worker.runner.model
    cfg = hf.config
    for layer, kind in zip(model.layers, cfg.layer_types):
        attn = layer.self_attn
        assert attn.sliding_window == (12 if kind == "sliding_attention" else None)
        assert attn.scale == 24 ** -0.5
        assert attn.logits_soft_cap == (20.0 if arch == "gemma2" else None)
        assert model.rope.table_of[kind] == layer.rope_index
    assert {"sliding_attention", "full_attention"} == set(cfg.layer_types)
    # Gemma 2 rotates every layer alike: one table; Gemma 3 a table per layer type
    assert model.rope.cos.shape[0] == (2 if arch == "gemma3" else 1)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_logits_match_transformers(checkpoint, backend):
    """A mixed batch (fresh prefills, chunks after cached context, decodes at up to 90 tokens: 7x the window)."""
    arch, path, hf = checkpoint
    engine = _engine(path, backend)
    assert_logits_match_hf(engine, hf, mixed_batch(seed=sum(map(ord, arch))), atol=1e-4, rtol=1e-4)
    assert engine.block_pool.counts()["in_use"] == 0


def test_fused_layer_ops_match_transformers(checkpoint):
    """The fused C++ ops, which the worker picks beside the kernel backends (RoPE in place on the fused q/k/v
    projection, GELU-tanh gating), in Gemma's layers on the reference backend."""
    from kvserve.models.layer_ops import load_fused_layer_ops

    fused = load_fused_layer_ops()
    if fused is None:
        pytest.skip("the C++ extension does not build here")
    arch, path, hf = checkpoint
    engine = _engine(path)
    engine.core.executor.worker.runner.model.ops = fused
    assert_logits_match_hf(engine, hf, mixed_batch(seed=5)[:4], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_greedy_tokens_match_transformers_with_chunked_prefill_and_prefix_hit(checkpoint, backend):
    """Three prompts sharing a 40-token prefix (over 3x the window), in 16-token chunks, the last after the others
    finish (a prefix-cache hit); every request's greedy tokens equal transformers'."""
    _, path, hf = checkpoint
    engine = _engine(path, backend, max_num_batched_tokens=16, enable_chunked_prefill=True)
    prompts = _prompts(1, (3, 11, 7), prefix=40)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    done = run_last_after_prefix(engine, prompts, params)
    assert done[str(len(prompts) - 1)].num_cached_tokens >= 32
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(hf, prompt, 10)[0], f"request {i}"


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_greedy_tokens_match_transformers_through_preemption(checkpoint, backend):
    """Five requests of 30-50 tokens in 10 blocks of 16: some are preempted and recomputed."""
    _, path, hf = checkpoint
    reqs = [(p, 12) for p in _prompts(2, (50, 31, 44, 38, 30))]
    engine, _ = assert_matches_hf(dict(model=path, attention_backend=backend, num_gpu_blocks_override=10,
                                       max_num_batched_tokens=32), reqs, hf)
    assert engine.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize(("change", "message"), [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "activation 'gelu'"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic RoPE"),
])
def test_variants_computed_differently_are_refused(tmp_path, change, message):
    """Gemma 3 configs whose network would differ from ours fail at load, by name."""
    import transformers as tf

    from tests.helpers.checkpoints import builtin_tokenizer

    cfg = tf.Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=12,
                              layer_types=["sliding_attention", "full_attention"], **change)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    builtin_tokenizer().save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=message):
        _engine(str(tmp_path))


@pytest.mark.parametrize("state_dict_names", [False, True])
def test_gemma3_multimodal_checkpoint_serves_its_text_part(tmp_path, state_dict_names):
    """A Gemma3ForConditionalGeneration checkpoint (a vision tower and projector beside the text model): its text
    tensors load, named as save_pretrained writes them (language_model.model.*) or as transformers 5 holds them
    (model.language_model.*), the rest is skipped, and the logits equal transformers' multimodal model's on text
    (which does not soft-cap them, whatever its text config says)."""
    from safetensors import safe_open

    hf = make_checkpoint(str(tmp_path), "gemma3_mm", seed=5, state_dict_names=state_dict_names)
    engine = _engine(str(tmp_path))
    assert engine.config.model.architecture == "Gemma3ForConditionalGeneration"
    assert 106 in engine.eos_token_ids  # the outer config's end-of-turn id, not only the text config's eos
    with safe_open(os.path.join(tmp_path, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    prefix = "model.language_model." if state_dict_names else "language_model.model."
    assert f"{prefix}layers.0.self_attn.q_norm.weight" in names
    assert any("vision_tower" in n for n in names) and any("multi_modal_projector" in n for n in names)
    assert engine.core.executor.worker.runner.model.final_logit_softcapping is None
    assert_logits_match_hf(engine, hf, mixed_batch(seed=4)[:4], atol=1e-4, rtol=1e-4)


def test_ngram_speculation_verifies_drafts_through_windows(checkpoint):
    """Draft tokens verified in one pass (several query rows per request, each with its own window): greedy tokens
    still equal transformers'."""
    _, path, hf = checkpoint
    engine = _engine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_min": 1, "prompt_lookup_max": 2, "adaptive": False})
    prompt = [5, 6, 7, 8] * 6
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    done = run_to_completion(engine)
    assert engine.scheduler.stats.num_spec_drafts > 0
    assert done["0"].outputs[0].token_ids == hf_greedy(hf, prompt, 24)[0]
