"""Disaggregated prefill -> decode in one process: two engines with the pull connector (kv_port 0), stepped in
turn with the block invariants checked on both after every step."""
from __future__ import annotations

from kvserve.sampling_params import SamplingParams
from tests.helpers.engine import check_engine_invariants


def pull_config(role: str, policy: str = "recompute", connector: str = "PullConnector", **extra) -> dict:
    return {"kv_connector": connector, "kv_role": role, "kv_port": 0, "kv_load_failure_policy": policy,
            "kv_connector_extra_config": extra}


def greedy(max_tokens: int, kv_transfer_params: dict | None = None) -> SamplingParams:
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def step_all(engines, until, max_steps: int = 200_000) -> dict:
    """Step every engine that has work, in turn, invariants after each step, until `until(finished)` (finished
    outputs by request id, over all engines) or every engine is idle."""
    finished = {}
    for _ in range(max_steps):
        busy = [e for e in engines if e.has_unfinished_requests()]
        if not busy or (until is not None and until(finished)):
            return finished
        for engine in busy:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            check_engine_invariants(engine)
    raise AssertionError("the engines did not settle")


def prefill(engine, prompts: dict[str, list[int]]) -> dict:
    """The prefill side's answers (max_tokens 1, do_remote_decode) by request id; their blocks stay held."""
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, greedy(1, {"do_remote_decode": True}))
    return step_all([engine], lambda done: set(prompts) <= set(done))


def disaggregated(prefill_engine, decode_engine, reqs: list[tuple[list[int], int]], ids: list[str] | None = None,
                  params_of=None) -> dict:
    """Each (prompt, max_tokens) prefilled on one engine, then decoded on the other with the prefill's
    kv_transfer_params (`params_of(req_id, params)` may change them); both engines stepped until idle. Returns the
    decode side's finished outputs by request id ("0", "1", ... unless `ids`)."""
    ids = ids or [str(i) for i in range(len(reqs))]
    answers = prefill(prefill_engine, {f"prefill-{i}": p for i, (p, _) in zip(ids, reqs)})
    for req_id, (prompt, max_tokens) in zip(ids, reqs):
        params = answers[f"prefill-{req_id}"].kv_transfer_params
        assert params is not None and params["do_remote_prefill"], answers[f"prefill-{req_id}"]
        if params_of is not None:
            params = params_of(req_id, params)
        decode_engine.add_request(req_id, prompt, greedy(max_tokens, params))
    return step_all([prefill_engine, decode_engine], None)


def assert_all_blocks_free(*engines) -> None:
    for engine in engines:
        assert not engine.scheduler.kv_held and not len(engine.scheduler.remote), "a transfer still holds blocks"
        engine.scheduler.kv.reset_prefix_cache()
        counts = engine.block_pool.counts()
        assert counts["free"] == engine.block_pool.num_blocks, counts
