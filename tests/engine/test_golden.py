"""Golden: many requests batched through a small KV pool (chunked prefill + preemption) give the same greedy
tokens as `transformers.generate` run on each request alone. Block invariants are checked after every step."""
from __future__ import annotations

import random

import pytest

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from tests.helpers.engine import ATTENTION_BACKENDS
from tests.helpers.golden import run_engine
from tests.helpers.oracles import assert_matches_hf


def _requests(seed: int, num: int, vocab: int, max_prompt: int, max_out: int):
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, max_prompt] + [rng.randint(1, max_prompt) for _ in range(num - 6)]
    return [([rng.randrange(3, vocab) for _ in range(n)], rng.randint(1, max_out)) for n in lengths]


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_golden_with_chunking_and_preemption(tiny_checkpoint, arch, backend):
    path, hf = tiny_checkpoint(arch)
    reqs = _requests(seed=1, num=18, vocab=49152, max_prompt=600, max_out=40)
    # 60 blocks x 16 = 960 tokens for ~5,000 tokens of demand: preemption is certain; 128-token budget
    # chunks every prompt over 128.
    engine, _ = assert_matches_hf(dict(model=path, num_gpu_blocks_override=60, max_num_batched_tokens=128,
                                       max_num_seqs=16, attention_backend=backend), reqs, hf)
    assert engine.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_batch_equals_singles_and_chunk_sizes(tiny_llama, backend):
    """Equivalence: one batch vs each request alone, across prefill chunk sizes {1, 3, 16, full}."""
    path, _ = tiny_llama
    reqs = _requests(seed=2, num=6, vocab=49152, max_prompt=70, max_out=12)
    results = []
    for budget in (1, 3, 16, 4096):
        engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=128, max_num_batched_tokens=budget,
                                   enable_prefix_caching=False, attention_backend=backend))
        out = run_engine(engine, reqs)
        results.append([out[str(i)].outputs[0].token_ids for i in range(len(reqs))])
    alone = []
    engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=128, attention_backend=backend))
    for i, r in enumerate(reqs):
        out = run_engine(engine, [r])
        alone.append(out["0"].outputs[0].token_ids)
    for r in results:
        assert r == alone
