"""The scheduler's asynchronous KV loads (WAITING_FOR_REMOTE_KVS) with a fake connector and no model: a request
whose KV loads in the background is admitted with blocks for its whole prompt and computes nothing until the
connector reports it in finished_recving; it then resumes as a prefix hit (all but its last prompt token). An
abort while it loads holds its blocks until the load stops; a failed load recomputes from the first bad block or
fails the request. Block invariants after every step; every block free at the end."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvserve.config.scheduler import SchedulerConfig
from kvserve.core_types import KVConnectorOutput, ModelRunnerOutput
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler

REMOTE = {"do_remote_prefill": True}


class _AsyncLoads:
    """Loads every prompt token but the last, asynchronously, for requests whose kv_transfer_params say so; holds
    the blocks of a request finished while its load runs."""

    def __init__(self, policy: str):
        self.transfer = SimpleNamespace(kv_load_failure_policy=policy)
        self.loading: set[str] = set()
        self.allocated: dict[str, list[int]] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not request.kv_transfer_params or request.request_id in self.allocated:
            return 0, False
        return request.num_prompt_tokens - 1 - num_computed_tokens, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens:
            self.loading.add(request.request_id)
            self.allocated[request.request_id] = list(block_ids)

    def build_connector_meta(self, scheduler_output):
        return None

    def update_connector_output(self, connector_output):
        self.loading -= connector_output.finished_recving

    def request_finished(self, request, block_ids):
        return request.request_id in self.loading, None


def _request(rid: str, prompt_len: int, remote: bool) -> Request:
    params = SamplingParams(max_tokens=3, ignore_eos=True, extra_args={"kv_transfer_params": REMOTE} if remote else None)
    return Request(rid, list(range(10 * len(rid), 10 * len(rid) + prompt_len)), params, max_tokens=3)


def _scheduler(policy: str = "recompute") -> Scheduler:
    kv = KVCacheManager(BlockPool(32), 4, True)
    return Scheduler(SchedulerConfig(8, 24, 4096, True), kv, kv_connector=_AsyncLoads(policy))


def _step(sched: Scheduler, recving=(), invalid=()) -> dict:
    out = sched.schedule()
    runner = ModelRunnerOutput(kv_connector_output=KVConnectorOutput(finished_recving=set(recving),
                                                                     invalid_block_ids=set(invalid)))
    for req_id, n in out.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        if req.num_computed_tokens + n >= req.num_tokens:
            runner.req_ids.append(req_id)
            runner.sampled_token_ids.append([7])
    outputs = {o.request_id: o for o in sched.update(out, runner)}
    sched.check_invariants()
    return {"out": out, "outputs": outputs}


def _drain(sched: Scheduler) -> None:
    for _ in range(50):
        if not sched.requests and not sched.kv_held:
            break
        _step(sched)
    sched.kv.reset_prefix_cache()
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks


def test_parked_until_loaded_then_a_prefix_hit():
    sched = _scheduler()
    sched.add_request(_request("a", 10, remote=True))
    sched.add_request(_request("b", 6, remote=False))
    first = _step(sched)["out"]
    assert set(first.num_scheduled_tokens) == {"b"}  # a computes nothing while it loads
    a = sched.requests["a"]
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS and sched.kv.num_blocks_held("a") == 3
    assert "a" not in _step(sched)["out"].num_scheduled_tokens
    _step(sched, recving={"a"})
    resumed = _step(sched)["out"]
    assert resumed.num_scheduled_tokens["a"] == 1  # the last prompt token, for its logits
    new = {n.req_id: n for n in resumed.scheduled_new_reqs}
    assert new["a"].num_computed_tokens == 9 and len(new["a"].block_ids) == 3
    assert a.num_cached_tokens == 9 and sched.stats.num_external_hit_tokens == 9
    _drain(sched)


def test_abort_while_loading_holds_the_blocks_until_the_load_stops():
    sched = _scheduler()
    sched.add_request(_request("a", 10, remote=True))
    _step(sched)
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert "a" in sched.kv_held and sched.kv.num_blocks_held("a") == 3
    _step(sched)
    assert "a" in sched.kv_held  # the load still writes them
    _step(sched, recving={"a"})
    assert not sched.kv_held
    _drain(sched)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load(policy):
    sched = _scheduler(policy)
    sched.add_request(_request("a", 10, remote=True))
    _step(sched)
    second_block = sched.connector.allocated["a"][1]
    outputs = _step(sched, recving={"a"}, invalid={second_block})["outputs"]
    assert sched.stats.num_kv_load_failures == 1
    if policy == "fail":
        assert outputs["a"].finish_reason == "error" and "kv_load_failure_policy is 'fail'" in outputs["a"].error
        assert "a" not in sched.requests
    else:
        a = sched.requests["a"]
        assert a.num_computed_tokens == 4 and a.num_cached_tokens == 4  # back to the first bad block
        assert _step(sched)["out"].num_scheduled_tokens["a"] == 6
    _drain(sched)
