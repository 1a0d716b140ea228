"""The architectures added beside Llama (Mixture-of-Experts: Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE; dense: Phi-3,
Granite) against transformers on tiny random-weight checkpoints written by transformers' own config classes.

Each checkpoint has 8 experts, 2 per token, dense and sparse layers mixed where the architecture allows it,
shared experts where it has them, and every weight randomised, 1-D ones (norms, biases) included, so that a
norm or bias we load wrongly changes the logits. Compared: the experts each token picks (before the logits,
where a near-tie could flip one), the logits of a mixed batch through the paged cache, and greedy tokens
through the engine with chunked prefill and a prefix-cache hit, through preemption, and through speculative
decoding (n-gram lookup, a draft model of the same architecture), block invariants after every step. Other
shapes and seeds: tests/engine/test_architecture_variants.py; TP=2: tests/e2e/test_tp_new_architectures.py.
"""
from __future__ import annotations

import argparse
import json
import os
import re

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.model_loader.weight_loader import expected_tensors
from kvserve.sampling_params import SamplingParams
from tests.helpers.architectures import (assert_every_tensor_consumed, checkpoint_tensor_names, chosen_experts,
                                         make_checkpoint, tiny_config)
from tests.helpers.engine import check_tables_cover_only_computed, run_last_after_prefix, run_to_completion
from tests.helpers.oracles import assert_matches_hf, hf_greedy, hf_logits, mixed_batch, paged_logits

MOE_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "granitemoe")
NEW_ARCHS = MOE_ARCHS + ("phi3", "granite")


@pytest.fixture(scope="module", params=NEW_ARCHS)
def checkpoint(request, tmp_path_factory):
    """(arch, path, transformers model) for each new architecture, written once per module."""
    path = str(tmp_path_factory.mktemp(request.param))
    return request.param, path, make_checkpoint(path, request.param)


def _engine(path: str, **kwargs) -> Engine:
    return Engine(EngineArgs(model=path, num_gpu_blocks_override=64, **kwargs))


def test_every_checkpoint_tensor_is_consumed(checkpoint):
    arch, path, _ = checkpoint
    engine = _engine(path)
    # transformers writes experts one tensor each, except Granite-MoE's, stacked
    assert_every_tensor_consumed(engine, path, stacked=arch == "granitemoe")
    model = engine.core.executor.worker.runner.model
    assert any(t.expert for t in expected_tensors(model).values()) == (arch in MOE_ARCHS)


def test_logits_and_chosen_experts_match_transformers(checkpoint):
    arch, path, hf = checkpoint
    engine = _engine(path)
    batch = mixed_batch(seed=sum(map(ord, arch)))
    ours, theirs = chosen_experts(engine, hf, batch[0][0])
    assert len(ours) == len(theirs) and bool(ours) == (arch in MOE_ARCHS)
    for got, want in zip(ours, theirs):
        assert torch.equal(got, want)
    for (tokens, ctx, q), got in zip(batch, paged_logits(engine, batch)):
        ref = hf_logits(hf, tokens[:ctx + q])[ctx:ctx + q]
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    engine.scheduler.check_invariants()
    assert engine.block_pool.counts()["in_use"] == 0


@pytest.mark.parametrize("moe_impl", ["sorted", "reference", "fused"])
def test_greedy_tokens_match_transformers_with_chunked_prefill_and_prefix_hit(checkpoint, moe_impl, monkeypatch):
    """Three prompts that share a 40-token prefix, in 16-token chunks, the last after the others finish (a
    prefix-cache hit); every request's greedy tokens equal transformers'."""
    arch, path, hf = checkpoint
    if moe_impl != "sorted" and arch not in MOE_ARCHS:
        pytest.skip("no experts")
    monkeypatch.setenv("KVSERVE_MOE_IMPL", moe_impl)
    engine = _engine(path, max_num_batched_tokens=16, enable_chunked_prefill=True)
    layers = engine.core.executor.worker.runner.model.layers
    assert all(layer.mlp.experts.impl == moe_impl for layer in layers if hasattr(layer.mlp, "experts"))
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 49152, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 49152, (n,), generator=g).tolist() for n in (3, 11, 7)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    done = run_last_after_prefix(engine, prompts, params)
    assert done[str(len(prompts) - 1)].num_cached_tokens >= 32
    for i, prompt in enumerate(prompts):
        want, _ = hf_greedy(hf, prompt, 8)
        assert done[str(i)].outputs[0].token_ids == want, f"request {i}"


def test_ngram_speculation_verifies_drafts_through_the_experts(checkpoint):
    """Draft tokens verified in one pass (several query rows per request through the experts): greedy tokens
    still equal transformers'."""
    arch, path, hf = checkpoint
    if arch not in MOE_ARCHS:
        pytest.skip("no experts")
    if arch == "granitemoe":  # NOTE: its 24 greedy tokens repeat no earlier token, for this and random prompts
        pytest.skip("this random Granite-MoE's greedy tokens never repeat: n-gram lookup proposes nothing")
    engine = _engine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_min": 1, "prompt_lookup_max": 2, "adaptive": False})
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.add_request("0", prompt, params)
    done = run_to_completion(engine)
    assert engine.scheduler.stats.num_spec_drafts > 0
    assert done["0"].outputs[0].token_ids == hf_greedy(hf, prompt, 24)[0]


def _shared_prefix_requests(seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens): six prompts of 1 to 70 tokens, four of them sharing a 24-token prefix (prefix hits
    among the requests queued together), some made of repeated segments (n-gram lookup finds drafts)."""
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(3, 49152, (n,), generator=g).tolist()

    prefix, segment = toks(24), toks(5)
    prompts = [prefix + toks(9), prefix + segment * 6, toks(1), prefix + toks(46), toks(17) + segment * 3,
               prefix + segment * 2]
    return [(p, n) for p, n in zip(prompts, (12, 16, 9, 14, 16, 11))]


@pytest.mark.parametrize("spec", [None, "ngram", "draft_model", "other_draft_model"])
def test_greedy_tokens_match_transformers_through_preemption(checkpoint, spec, tmp_path):
    """A pool of 14 blocks of 8 tokens for six requests of up to 84 tokens queued at once: requests are
    preempted and recomputed, prompts are chunked (24 tokens a step) and hit each other's prefixes; with
    speculation, drafts (n-gram lookup; the checkpoint as its own draft model; another checkpoint of the same
    architecture, other weights, whose drafts are mostly rejected) are verified through the experts. Every
    request's greedy tokens equal transformers'; block invariants after every step."""
    arch, path, hf = checkpoint
    draft = path
    if spec == "other_draft_model":
        make_checkpoint(str(tmp_path), arch, seed=99)
        draft = str(tmp_path)
    speculative = None if spec is None else {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False} if spec == "ngram" else {
        "method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive": False}
    reqs = _shared_prefix_requests(seed=len(arch))
    engine, done = assert_matches_hf(dict(model=path, num_gpu_blocks_override=14, block_size=8,
                                          max_num_batched_tokens=24, max_num_seqs=6,
                                          speculative_config=speculative), reqs, hf,
                                     # NOTE: a draft model holds look-ahead slots past the verified tokens
                                     after_step=check_tables_cover_only_computed if spec in (None, "ngram") else None)
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0
    # n-gram lookup proposes once a sampled token occurred earlier (random weights may never repeat one)
    outs = [done[str(i)].outputs[0].token_ids for i in range(len(reqs))]
    lookup_hits = any(out[j] in prompt + out[:j] for (prompt, _), out in zip(reqs, outs) for j in range(len(out) - 1))
    if spec in ("draft_model", "other_draft_model") or (spec == "ngram" and lookup_hits):
        assert stats.num_spec_drafts > 0
    if spec == "draft_model":  # its own draft: nearly every draft accepted
        assert stats.num_spec_accepted_tokens > 0.9 * stats.num_spec_draft_tokens
    if spec == "other_draft_model":  # unrelated weights: most drafts rejected
        assert stats.num_spec_accepted_tokens < 0.5 * stats.num_spec_draft_tokens


def test_stacked_expert_tensors_load_as_per_expert_ones(tmp_path):
    """A checkpoint holding transformers' stacked expert tensors (`mlp.experts.gate_up_proj`) loads and gives
    the same logits."""
    hf = make_checkpoint(str(tmp_path), "qwen3_moe", seed=3, stacked_experts=True)
    assert "model.layers.0.mlp.experts.gate_up_proj" in checkpoint_tensor_names(str(tmp_path))
    engine = _engine(str(tmp_path))
    batch = mixed_batch(seed=11)[:3]
    for (tokens, ctx, q), got in zip(batch, paged_logits(engine, batch)):
        torch.testing.assert_close(got, hf_logits(hf, tokens[:ctx + q])[ctx:ctx + q], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("arch", "dropped"), [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.5.w3.weight"),      # one expert's tensor of many
    ("granitemoe", "model.layers.0.block_sparse_moe.output_linear.weight"),  # a stacked tensor
])
def test_checkpoint_missing_expert_tensor_is_named(tmp_path, arch, dropped):
    from safetensors.torch import load_file, save_file

    make_checkpoint(str(tmp_path), arch)
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(file)
    del tensors[dropped]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing tensors: {re.escape(dropped)}$"):
        _engine(str(tmp_path))


def test_olmoe_refuses_tensor_parallelism():
    from kvserve.config.parallel import ParallelConfig
    from kvserve.model_loader.loader import normalize_config

    cfg = normalize_config(tiny_config("olmoe"))
    cfg.architectures = ["OlmoeForCausalLM"]
    with pytest.raises(ValueError, match="OlmoeForCausalLM does not run with tensor parallelism"):
        ParallelConfig(tensor_parallel_size=2).check_model(cfg)


def test_kv_calc_sizes_the_new_architectures(checkpoint, capsys):
    """MoE does not change the KV cache: 2 (K, V) x layers x KV heads x head_dim x 4 bytes per token."""
    from kvserve.cli import kv_calc

    arch, path, hf = checkpoint
    parser = argparse.ArgumentParser(prog="kvserve kv-calc")
    kv_calc.add_arguments(parser)
    assert kv_calc.run(parser.parse_args(["--model", path, "--kv-dtype", "float32", "--json"])) == 0
    report = json.loads(capsys.readouterr().out)
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert report["kv_bytes_per_token"] == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
