"""A model windowed on every layer (tiny Mistral, W 10, block size 4) releases the blocks before each running
request's window: its requests hold a bounded number of blocks however long they get, prefix hits need only
the window's blocks, and preemption and rejected drafts leave the accounting exact. Tokens against
transformers' greedy tokens, block invariants after every step, every block free at the end."""
from __future__ import annotations

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.sampling_params import SamplingParams
from tests.helpers.architectures import make_checkpoint
from tests.helpers.engine import ATTENTION_BACKENDS, run_to_completion, step_until_idle
from tests.helpers.oracles import assert_matches_hf, hf_greedy

W, BS, BUDGET = 10, 4, 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mistral_window"))
    return path, make_checkpoint(path, "mistral_window")


def _engine(path: str, backend: str, num_blocks: int = 64, **kwargs) -> Engine:
    kwargs = {"speculative_config": None, **kwargs}
    return Engine(EngineArgs(model=path, attention_backend=backend, block_size=BS, num_gpu_blocks_override=num_blocks,
                             max_num_batched_tokens=BUDGET, **kwargs))


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Bounded:
    """An after_step check: each request that ran holds only the blocks its step's first window and tokens span,
    positions p0 - W + 1 .. p0 + n - 1 for n tokens from p0 (a decode: ceil(W / BS) + 1 blocks at most). It
    records what each step scheduled by wrapping the engine's scheduler."""

    def __init__(self, engine: Engine):
        self.scheduled: dict[str, int] = {}
        self.most = 0
        schedule = engine.scheduler.schedule

        def recording():
            out = schedule()
            self.scheduled = dict(out.num_scheduled_tokens)
            return out

        engine.scheduler.schedule = recording

    def __call__(self, engine: Engine) -> None:
        kv = engine.scheduler.kv
        for req in engine.scheduler.running:
            n = self.scheduled.get(req.request_id)
            if n is None:
                continue
            live = kv.num_live_blocks(req.request_id)
            assert live <= -(-(W - 1 + n) // BS) + 1, (req.request_id, n, live)
            self.most = max(self.most, kv.num_blocks_held(req.request_id))


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_long_requests_hold_a_bounded_number_of_blocks(mistral, backend):
    path, hf = mistral
    reqs = [(_prompt(1, 40), 12), (_prompt(2, 23), 20), (_prompt(3, 5), 36)]
    engine = _engine(path, backend, num_blocks=20)  # released blocks are soon reused: a misread shows
    bounded = Bounded(engine)
    assert_matches_hf(None, reqs, hf, engine=engine, after_step=bounded)
    assert engine.scheduler.kv.sliding_window == W
    assert bounded.most >= 12  # tables grew well past the blocks their requests held


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_prefix_hit_after_the_prefix_start_was_evicted(mistral, backend):
    path, hf = mistral
    # 12 pool blocks: the first request (13 blocks of computed tokens) reuses its own oldest released block.
    engine = _engine(path, backend, num_blocks=13)
    bounded = Bounded(engine)
    shared = _prompt(4, 44)
    first, second = shared + [5, 6, 7], shared + [8, 9]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("first", first, greedy)
    done = step_until_idle(engine, after_step=bounded)
    kv = engine.scheduler.kv
    # The null block is the cache's last block, past the pool's 12.
    assert kv.null_block.block_id == engine.block_pool.num_blocks == 12
    assert engine.core.executor.worker.runner.kv_caches[0].shape[0] == 13
    # The shared prefix's first block is gone, the blocks its end's window reads are not.
    assert kv.explain(shared[:BS + 1]).num_hit_tokens == 0
    assert kv.explain(shared + [9]).num_hit_tokens == 44
    engine.add_request("second", second, greedy)
    done |= run_to_completion(engine, after_step=bounded)
    assert engine.scheduler.stats.num_prefix_hit_tokens == 44
    for name, prompt in (("first", first), ("second", second)):
        assert done[name].outputs[0].token_ids == hf_greedy(hf, prompt, 6)[0], name


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_preemption_in_a_small_pool(mistral, backend):
    path, hf = mistral
    reqs = [(_prompt(10 + i, 9 + 7 * i), 30) for i in range(4)]
    engine = _engine(path, backend, num_blocks=13)
    assert_matches_hf(None, reqs, hf, engine=engine, after_step=Bounded(engine))
    assert engine.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_speculative_rollbacks(mistral, backend):
    path, hf = mistral
    # Repeated phrases give the n-gram proposer drafts; random weights reject most of them.
    reqs = [((_prompt(20, 6) * 4)[:22], 30), ((_prompt(21, 5) * 5)[:19], 26)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "adaptive": False}
    engine = _engine(path, backend, num_blocks=14, speculative_config=spec)
    assert_matches_hf(None, reqs, hf, engine=engine, after_step=Bounded(engine))
    stats = engine.scheduler.stats
    assert stats.num_spec_drafts > 0 and stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_prompt_logprobs_are_recomputed_through_the_window(mistral, backend):
    """A request that needs prompt logprobs computes its whole prompt (no hit, though its prompt is cached),
    releasing blocks as it goes; each prompt token's logprob equals transformers'."""
    path, hf = mistral
    prompt = _prompt(30, 41)
    engine = _engine(path, backend, num_blocks=13)
    bounded = Bounded(engine)
    engine.add_request("warm", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    step_until_idle(engine, after_step=bounded)
    engine.add_request("logprobs", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                          prompt_logprobs=0))
    out = run_to_completion(engine, after_step=bounded)["logprobs"]
    assert out.num_cached_tokens == 0
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        assert abs(entries[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4, i
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 5)[0]
