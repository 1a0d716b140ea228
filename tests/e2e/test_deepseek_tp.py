"""DeepSeek (MLA + grouped top-k MoE) over two tensor-parallel ranks (gloo, CPU): the heads, the experts' and
MLPs' intermediate dimension and the vocabulary split, the latent cache whole on each rank; the same tokens
and logprobs as one rank through chunked prefill, prefix hits, n-gram drafts and preemption."""
from __future__ import annotations

import pytest

from kvserve.engine.llm import LLM
from tests.helpers.architectures import make_checkpoint
from tests.helpers.tensor_parallel import TP_ARGS, assert_same_outputs, run_tp, tp_mixed_batch


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def engines(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    make_checkpoint(path, request.param)
    pair = [LLM(path, tensor_parallel_size=n, **TP_ARGS) for n in (1, 2)]
    yield pair
    pair[1].shutdown()


def test_tp2_matches_tp1_on_a_mixed_batch(engines):
    prompts, params = tp_mixed_batch()
    ref, out = (run_tp(llm, prompts, params) for llm in engines)
    stats = engines[1].engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0
    assert_same_outputs(ref, out)


def test_each_rank_holds_half_the_heads_and_the_whole_latent_cache(engines):
    tp1, tp2 = engines
    spec1, spec2 = tp1.engine.core.kv_spec, tp2.engine.core.kv_spec
    assert spec1.latent and spec2 == spec1
    attn1 = tp1.engine.core.executor.worker.model.layers[0].self_attn
    attn2 = tp2.engine.core.executor.worker.model.layers[0].self_attn
    assert attn2.num_heads * 2 == attn1.num_heads
    assert attn2.kv_b_proj.weight.shape[0] * 2 == attn1.kv_b_proj.weight.shape[0]
    assert attn2.kv_a_proj_with_mqa.weight.shape == attn1.kv_a_proj_with_mqa.weight.shape
