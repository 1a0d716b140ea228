"""Tensor parallelism (TP=2, worker processes over gloo) on the new architectures against transformers."""
from __future__ import annotations

import pytest
import torch

from kvserve.sampling_params import SamplingParams
from tests.helpers.architectures import make_checkpoint
from tests.helpers.engine import run_to_completion
from tests.helpers.oracles import hf_greedy


@pytest.mark.parametrize("arch", ["qwen2_moe", "phi3", "gemma2", "gemma3"])
def test_tensor_parallel_two_ranks_match_transformers(tmp_path, arch):
    """TP=2 (gloo): experts split over their intermediate dimension, the shared expert as a dense MLP (Qwen2-MoE);
    the checkpoint's fused qkv_proj / gate_up_proj cut into each rank's heads and rows (Phi-3); Gemma's heads split,
    its (1 + w) norms and soft caps on every rank, the vocabulary-parallel head soft-capped after its gather."""
    from kvserve.engine.llm import LLM

    hf = make_checkpoint(str(tmp_path), arch, seed=5)
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
