"""KV connectors under tensor parallelism (TP=2, worker processes): each rank saves and loads its own KV heads;
greedy tokens and logprobs equal a TP=1 engine's without a connector over the mixed batch (chunked prefill,
prefix hits, drafts, preemption); a new TP=2 engine on the same directory takes external hits; a corrupt file
of one rank is recomputed on both."""
from __future__ import annotations

import os

import pytest

from kvserve.engine.llm import LLM
from tests.helpers.kv_connectors import flip_a_byte, offloading_config, storage_config, stored_blocks
from tests.helpers.tensor_parallel import TP_ARGS, assert_same_outputs, run_tp, tp_mixed_batch


@pytest.fixture(scope="module")
def reference(tiny_llama):
    prompts, params = tp_mixed_batch()
    return run_tp(LLM(tiny_llama[0], **TP_ARGS), prompts, params)


def _tp2(path: str, kv: dict) -> LLM:
    return LLM(path, tensor_parallel_size=2, kv_transfer_config=kv, **TP_ARGS)


def test_shared_storage_tp2(tiny_llama, reference, tmp_path):
    path = tiny_llama[0]
    prompts, params = tp_mixed_batch()
    first = _tp2(path, storage_config(tmp_path))
    try:
        assert_same_outputs(reference, run_tp(first, prompts, params))
    finally:
        first.shutdown()
    assert stored_blocks(tmp_path, tp_size=2)  # each rank wrote its own heads' files and marker
    for block in stored_blocks(tmp_path, tp_size=2)[::2]:
        flip_a_byte(os.path.join(block, "layer_0.rank1.kv"))  # rank 1's part of every other block is bad
    second = _tp2(path, storage_config(tmp_path))
    try:
        assert_same_outputs(reference, run_tp(second, prompts, params))
        stats = second.engine.scheduler.stats
        assert stats.num_kv_load_failures > 0 and stats.num_external_hit_tokens > 0  # both ranks recomputed
    finally:
        second.shutdown()


def test_offloading_tp2(tiny_llama, reference):
    prompts, params = tp_mixed_batch()
    llm = _tp2(tiny_llama[0], offloading_config(64))
    try:
        assert_same_outputs(reference, run_tp(llm, prompts, params))
        llm.engine.scheduler.kv.reset_prefix_cache()  # the device pool forgets: the host tier has the prompts
        assert_same_outputs(reference, run_tp(llm, prompts, params))
        assert llm.engine.scheduler.stats.num_external_hit_tokens > 0
    finally:
        llm.shutdown()
