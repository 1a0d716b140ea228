"""The model runner's sampling alone: the batch, the per-request fallback, accepted drafts."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import CachedRequestState, InputBatch
from kvserve.worker.sampling import SamplingPlan, draft_prefixes, sample_step

VOCAB = 10
CPU = torch.device("cpu")


class _Sampler:
    """Argmax per row; draws once per row from the row's generator; raises on a row whose logit 0 is negative."""

    def __init__(self):
        self.calls = 0

    def __call__(self, logits, meta):
        self.calls += 1
        for g in meta.generators.values():
            torch.rand(1, generator=g)
        if (logits[:, 0] < 0).any():
            raise ValueError("bad row")
        return SimpleNamespace(sampled_token_ids=logits.argmax(-1).tolist(), logprobs=[None] * len(logits))


def _setup(bad: bool = False, seed: int | None = None):
    batch = InputBatch(max_num_reqs=4, max_model_len=32, max_num_blocks_per_req=4)
    for rid in ("a", "b", "c"):
        params = SamplingParams(temperature=1.0, seed=seed) if rid == "a" and seed is not None else SamplingParams()
        generator = torch.Generator().manual_seed(seed) if rid == "a" and seed is not None else None
        batch.add(CachedRequestState(req_id=rid, prompt_token_ids=[1, 2], sampling_params=params, eos_token_ids=(),
                                     generator=generator, num_computed_tokens=2), [0])
    picks = [3, 5, 6, 7, 4]  # a: 3; b verifies drafts [5, 6]: 5, 6 accepted, 7 the bonus; c: 4
    logits = torch.zeros(5, VOCAB)
    logits[torch.arange(5), torch.tensor(picks)] = 1.0
    if bad:
        logits[4, 0] = -1.0
    inputs = SimpleNamespace(sample_req_ids=["a", "b", "c"], drafts=[[], [5, 6], []],
                             num_logits=np.array([1, 3, 1]), sample_rows=np.array([0, 1, 1, 1, 2]), grammar=None)
    return batch, logits, inputs


def test_the_batch_samples_in_one_go_and_keeps_accepted_drafts():
    batch, logits, inputs = _setup()
    sampler = _Sampler()
    out = sample_step(sampler, batch, logits, inputs, VOCAB, CPU)
    assert out.req_ids == ["a", "b", "c"] and out.sampled_token_ids == [[3], [5, 6, 7], [4]]
    assert out.errors == {} and out.logprobs is None and sampler.calls == 1


def test_a_rejected_draft_ends_the_request_tokens():
    batch, logits, inputs = _setup()
    logits[2] = 0.0
    logits[2, 9] = 1.0  # the target samples 9 where the draft said 6
    assert sample_step(_Sampler(), batch, logits, inputs, VOCAB, CPU).sampled_token_ids == [[3], [5, 9], [4]]


def test_a_request_that_raises_fails_alone_and_seeds_are_restored_first():
    batch, logits, inputs = _setup(bad=True, seed=7)
    sampler = _Sampler()
    out = sample_step(sampler, batch, logits, inputs, VOCAB, CPU)
    assert out.req_ids == ["a", "b"] and out.sampled_token_ids == [[3], [5, 6, 7]]
    assert out.errors == {"c": "sampling failed: ValueError: bad row"} and sampler.calls == 4
    # "a" drew in the failed batch and again alone: its generator is where one draw from the seed leaves it
    once = torch.Generator().manual_seed(7)
    torch.rand(1, generator=once)
    assert torch.equal(batch.states[0].generator.get_state(), once.get_state())


def test_the_plan_and_draft_prefixes():
    batch, _, inputs = _setup()
    plan = SamplingPlan.of(batch, inputs)
    assert plan.offsets.tolist() == [0, 1, 4, 5] and plan.rows(1) == (1, 4) and plan.saved == {}
    assert plan.prefixes == [[], [], [5], [5, 6], []]
    one = plan.only(1)
    assert one.req_ids == ["b"] and one.offsets.tolist() == [0, 3] and one.prefixes == [[], [5], [5, 6]]
    assert draft_prefixes([[], []]) is None
