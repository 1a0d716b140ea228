"""The playbook's baseline modes on a tiny checkpoint: static batching and contiguous KV reservation give
transformers' greedy tokens (block invariants after every step, every block free at the end)."""
from __future__ import annotations

import random

import pytest

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from tests.helpers.oracles import assert_matches_hf


def _requests(seed: int, n: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(1, 1000) for _ in range(rng.randrange(3, 40))], rng.choice([2, 5, 17])) for _ in range(n)]


@pytest.mark.parametrize("chunked", [True, False])
def test_static_batching_gives_transformers_tokens(tiny_llama, chunked):
    path, hf = tiny_llama
    engine, _ = assert_matches_hf(dict(model=path, num_gpu_blocks_override=64, max_model_len=128, max_num_seqs=4,
                                       max_num_batched_tokens=48, enable_chunked_prefill=chunked,
                                       static_batching=True), _requests(1, 9), hf)
    assert engine.scheduler.batch.enabled


def test_contiguous_reservation_gives_transformers_tokens(tiny_llama):
    path, hf = tiny_llama
    peak = []
    engine, _ = assert_matches_hf(dict(model=path, num_gpu_blocks_override=24, max_model_len=64, max_num_seqs=8,
                                       max_num_batched_tokens=64, kv_reservation="contiguous"),
                                  _requests(2, 8), hf, after_step=lambda e: peak.append(len(e.scheduler.running)))
    assert max(peak) == 6  # 24 blocks / (64 tokens / 16 a block)
    assert engine.scheduler.stats.num_preemptions == 0


def test_contiguous_reservation_larger_than_the_pool_is_refused(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match=r"sets aside max_model_len \(512 tokens = 32 blocks\) per request, but "
                                         r"the KV pool holds 16 blocks"):
        Engine(EngineArgs(model=path, num_gpu_blocks_override=16, max_model_len=512, kv_reservation="contiguous"))


def test_bad_kv_reservation_is_refused():
    with pytest.raises(ValueError, match="kv_reservation must be one of paged, contiguous, got 'slab'"):
        EngineArgs(kv_reservation="slab")
