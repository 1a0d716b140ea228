"""Tensor parallelism (TP=2, worker processes over gloo) on the new architectures against transformers: every one
whose heads two ranks divide (OLMoE's full-width q/k norm refuses TP: test_new_architectures.py)."""
from __future__ import annotations

import pytest
import torch

from kvserve.sampling_params import SamplingParams
from tests.helpers.architectures import make_checkpoint
from tests.helpers.engine import run_to_completion
from tests.helpers.oracles import hf_greedy
from tests.helpers.tensor_parallel import TP_ARGS, run_tp, tp_mixed_batch

# Phi-4-mini-style partial RoPE with Phi-3-128k-style longrope switching at 16 tokens: of the two prompts below,
# one is past the switch (long factors) and one stays within it (short)
_PHI3_ROPE = dict(partial_rotary_factor=0.5, original_max_position_embeddings=16,
                  rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3],
                                "long_factor": [2.0, 2.7, 3.4, 4.1]})
TP_ARCHS = [("qwen3_moe", {}), ("mixtral", {}), ("qwen2_moe", {}), ("granitemoe", {}), ("phi3", {}),
            ("granite", {}), ("phi3", _PHI3_ROPE), ("granite", dict(attention_bias=True, mlp_bias=True)),
            ("gemma2", {}), ("gemma3", {})]


@pytest.mark.parametrize(("arch", "overrides"), TP_ARCHS,
                         ids=["qwen3_moe", "mixtral", "qwen2_moe", "granitemoe", "phi3", "granite", "phi3-rope",
                              "granite-bias", "gemma2", "gemma3"])
def test_tensor_parallel_two_ranks_match_transformers(tmp_path, arch, overrides):
    """TP=2 (gloo): experts split over their intermediate dimension, the shared expert as a dense MLP (Qwen2-MoE);
    the checkpoint's fused qkv_proj / gate_up_proj cut into each rank's heads and rows (Phi-3), each rank's
    heads rotated over their leading dims with the factor set of their request (partial RoPE, longrope); o_proj's
    and down_proj's biases added once, after the sum over ranks (Granite's attention_bias, mlp_bias); Gemma's
    heads split, its (1 + w) norms and soft caps on every rank, the vocabulary-parallel head soft-capped after its
    gather."""
    from kvserve.engine.llm import LLM

    hf = make_checkpoint(str(tmp_path), arch, seed=5, **overrides)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, num_gpu_blocks_override=64, max_num_batched_tokens=16,
              num_threads=1)
    try:
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (29, 5)]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(str(i), prompt, params)
        done = run_to_completion(llm.engine)
    finally:
        llm.shutdown()
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(hf, prompt, 6)[0], f"request {i}"


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "granitemoe"])
def test_tensor_parallel_mixed_batch_with_preemption_and_speculation(tmp_path, arch):
    """The TP equivalence batch (chunked prefills, prefix hits, preemptions: tests/helpers/tensor_parallel.py)
    with n-gram drafts verified through the split experts: every request's greedy tokens equal transformers'."""
    from kvserve.engine.llm import LLM

    hf = make_checkpoint(str(tmp_path), arch, seed=6)
    prompts, params = tp_mixed_batch()
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **TP_ARGS,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "adaptive": False})
    try:
        outs = run_tp(llm, prompts, params)
        stats = llm.engine.scheduler.stats
    finally:
        llm.shutdown()
    assert stats.num_preemptions > 0
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        assert outs[i].outputs[0].token_ids == hf_greedy(hf, prompt, sp.max_tokens)[0], f"request {i}"
