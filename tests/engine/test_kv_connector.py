"""KV connectors (--kv-transfer-config) on tiny checkpoints: greedy tokens equal transformers' (or an engine's
without the connector, for a quantized cache) with the connector on, over a mixed batch with prefix hits,
chunked prefill and preemption; a new engine on the same store takes external hits; offload -> evict -> hit;
a corrupt store under each kv_load_failure_policy. Block accounting after every step, every block free at the
end (tests/helpers/engine.py)."""
from __future__ import annotations

import os

import pytest

from kvserve import LoRARequest
from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.helpers.engine import run_to_completion, step_until_idle
from tests.helpers.kv_connectors import flip_a_byte, layer_files, offloading_config, storage_config, stored_blocks
from tests.helpers.lora import ADAPTERS, make_adapter
from tests.helpers.oracles import assert_matches_hf

# block 4, 24 blocks, 16 tokens a step: prompts are chunked, the six requests do not fit at once (preemption),
# and requests 1-2 and 4-5 share prefixes with the one before them (prefix hits).
ENGINE = dict(block_size=4, num_gpu_blocks_override=24, max_num_batched_tokens=16)
_SHARED = list(range(300, 318))
REQS = [(list(range(100, 126)), 8), (_SHARED + [7, 8, 9], 8), (_SHARED + [11, 12], 6),
        (list(range(900, 913)), 8), (list(range(200, 230)), 5), (list(range(200, 222)) + [5], 7)]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _run(engine: Engine, reqs=REQS) -> dict[str, list[int]]:
    for i, (prompt, max_tokens) in enumerate(reqs):
        engine.add_request(str(i), prompt, _greedy(max_tokens))
    return {k: list(v.outputs[0].token_ids) for k, v in run_to_completion(engine).items()}


def test_shared_storage_outputs_match_hf_and_a_new_engine_hits(tiny_llama, tmp_path):
    path, hf = tiny_llama
    kwargs = dict(model=path, **ENGINE, kv_transfer_config=storage_config(tmp_path))
    first, _ = assert_matches_hf(kwargs, REQS, hf)
    assert first.scheduler.stats.num_preemptions > 0
    saved = stored_blocks(tmp_path)
    assert saved and all(len(layer_files(d)) == first.hf_config.num_hidden_layers for d in saved)
    # a new engine (a new process would do the same: the names are digests) loads the prompts' full blocks
    second, _ = assert_matches_hf(kwargs, REQS, hf)
    hits = second.scheduler.stats.num_external_hit_tokens
    assert hits >= sum((len(p) - 1) // 4 * 4 for p, _ in REQS) // 2, hits
    assert second.core.kv_connector.num_external_hit_tokens >= hits  # resumptions after preemption load too


@pytest.mark.parametrize("engine_kwargs", [dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8_e4m3"),
                                           dict(dtype="bfloat16")], ids=["int8", "fp8", "bf16"])
def test_shared_storage_every_kv_cache_dtype(tiny_llama, tmp_path, engine_kwargs):
    path, _ = tiny_llama
    kwargs = dict(model=path, **ENGINE, **engine_kwargs)
    want = _run(Engine(EngineArgs(**kwargs)))
    kwargs["kv_transfer_config"] = storage_config(tmp_path)
    assert _run(Engine(EngineArgs(**kwargs))) == want
    second = Engine(EngineArgs(**kwargs))
    assert _run(second) == want
    assert second.scheduler.stats.num_external_hit_tokens > 0


def test_producer_saves_and_consumer_loads_only(tiny_llama, tmp_path):
    path, hf = tiny_llama
    consumer = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=storage_config(tmp_path, "kv_consumer")))
    _run(consumer, REQS[:2])
    assert stored_blocks(tmp_path) == []
    producer = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=storage_config(tmp_path, "kv_producer")))
    _run(producer, REQS[:2])
    _run(producer, REQS[:2])
    assert producer.scheduler.stats.num_external_hit_tokens == 0 and stored_blocks(tmp_path)
    consumer = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=storage_config(tmp_path, "kv_consumer")))
    assert_matches_hf(None, REQS[:2], hf, engine=consumer)
    assert consumer.scheduler.stats.num_external_hit_tokens > 0


def _evict_prompt(engine: Engine, prompt: list[int]) -> None:
    """Run other prompts (cache kept) until none of `prompt`'s blocks is left in the device pool's prefix cache."""
    assert engine.core.explain_prefix(prompt).num_hit_tokens > 0
    for i in range(4):
        engine.add_request(f"evict{i}", list(range(1000 + 40 * i, 1036 + 40 * i)), _greedy(2))
    step_until_idle(engine)
    assert engine.core.explain_prefix(prompt).num_hit_tokens == 0


def _run_keeping_cache(engine: Engine, req_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request(req_id, prompt, _greedy(max_tokens))
    return list(step_until_idle(engine)[req_id].outputs[0].token_ids)


def test_offloading_evicted_blocks_come_back_from_host_memory(tiny_llama):
    path, hf = tiny_llama
    engine = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=offloading_config(64)))
    prompt, max_tokens = REQS[0]
    first = _run_keeping_cache(engine, "first", prompt, max_tokens)
    assert engine.scheduler.stats.num_external_hit_tokens == 0
    _evict_prompt(engine, prompt)
    _, again = assert_matches_hf(None, [REQS[0]], hf, engine=engine)
    assert list(again["0"].outputs[0].token_ids) == first
    assert engine.scheduler.stats.num_external_hit_tokens == (len(prompt) - 1) // 4 * 4
    assert 0 < engine.core.kv_connector.num_host_blocks_used <= 64


def test_offloading_host_tier_is_bounded(tiny_llama):
    path, hf = tiny_llama
    engine = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=offloading_config(3)))
    prompt, max_tokens = REQS[0]
    _run_keeping_cache(engine, "first", prompt, max_tokens)
    assert engine.core.kv_connector.num_host_blocks_used == 3
    _evict_prompt(engine, prompt)  # the host tier's three blocks are the last prompts' now
    assert_matches_hf(None, [REQS[0]], hf, engine=engine)
    assert engine.scheduler.stats.num_external_hit_tokens == 0
    assert engine.core.kv_connector.num_host_blocks_used == 3


def test_multi_connector_loads_from_the_first_that_has_it_and_saves_to_all(tiny_llama, tmp_path):
    path, hf = tiny_llama
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
        offloading_config(64), storage_config(tmp_path)]}}
    kwargs = dict(model=path, **ENGINE, kv_transfer_config=multi)
    assert_matches_hf(kwargs, REQS[:1], hf)
    assert stored_blocks(tmp_path)
    engine = Engine(EngineArgs(**kwargs))   # a new engine: its host tier is empty, the directory is not
    assert_matches_hf(None, REQS[:1], hf, engine=engine)
    offload, storage = engine.core.kv_connector.connectors
    assert offload.num_external_hit_tokens == 0 and storage.num_external_hit_tokens > 0
    prompt, max_tokens = REQS[3]
    first = _run_keeping_cache(engine, "first", prompt, max_tokens)  # computed here: saved to both
    assert offload.num_host_blocks_used > 0
    _evict_prompt(engine, prompt)
    loaded_from_storage = storage.num_external_hit_tokens
    _, again = assert_matches_hf(None, [REQS[3]], hf, engine=engine)
    assert list(again["0"].outputs[0].token_ids) == first
    assert offload.num_external_hit_tokens > 0 and storage.num_external_hit_tokens == loaded_from_storage


def _corrupt_first_block(tmp_path) -> None:
    """Corrupt one layer file of every stored block (whichever block a request loads first is bad)."""
    for block in stored_blocks(tmp_path):
        flip_a_byte(layer_files(block)[-1])


def test_corrupt_store_recompute_policy(tiny_llama, tmp_path):
    path, hf = tiny_llama
    kwargs = dict(model=path, **ENGINE, kv_transfer_config=storage_config(tmp_path))
    assert_matches_hf(kwargs, REQS[:2], hf)
    _corrupt_first_block(tmp_path)
    engine, _ = assert_matches_hf(kwargs, REQS[:2], hf)
    assert engine.scheduler.stats.num_kv_load_failures == 2
    # the recompute saved the blocks again: a third engine loads them all
    engine, _ = assert_matches_hf(kwargs, REQS[:2], hf)
    assert engine.scheduler.stats.num_kv_load_failures == 0
    assert engine.scheduler.stats.num_external_hit_tokens > 0


def test_missing_or_corrupt_store_fail_policy(tiny_llama, tmp_path):
    path, hf = tiny_llama
    assert_matches_hf(dict(model=path, **ENGINE, kv_transfer_config=storage_config(tmp_path)), REQS[:2], hf)
    blocks = stored_blocks(tmp_path)
    _corrupt_first_block(tmp_path)
    os.unlink(layer_files(blocks[0])[0])  # and one file missing outright
    engine = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=storage_config(tmp_path, policy="fail")))
    engine.add_request("ok", list(range(700, 720)), _greedy(4))
    for i, (prompt, max_tokens) in enumerate(REQS[:2]):
        engine.add_request(str(i), prompt, _greedy(max_tokens))
    done = run_to_completion(engine)
    for i in ("0", "1"):
        out = done[i].outputs[0]
        assert out.finish_reason == "error" and out.token_ids == []
        assert "kv_load_failure_policy is 'fail'" in out.error, out.error
    assert done["ok"].outputs[0].finish_reason == "length"


def test_out_of_tree_connector_gets_every_hook_in_order(tiny_llama):
    path, _ = tiny_llama
    engine = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config={
        "kv_connector": "RecordingConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "tests.helpers.kv_connectors"}))
    _run(engine, REQS[:1])
    sched = engine.core.kv_connector
    worker = engine.core.executor.worker.runner.kv_connector.connector
    assert sched.calls[:3] == ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta"]
    assert sched.calls[-1] == "request_finished"
    layers = worker.num_layers
    step = ["start_load_kv"] + ["wait_for_layer_load"] * layers + ["save_kv_layer"] * layers + [
        "wait_for_save", "get_finished"]
    assert worker.calls[0] == "register_kv_caches" and worker.calls[1:1 + len(step)] == step


def test_unsupported_combinations_fail_at_start_up(tiny_llama, tmp_path):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="unknown kv_connector 'NoSuchConnector'"):
        Engine(EngineArgs(model=path, kv_transfer_config={"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}))
    bad_extra = storage_config(tmp_path) | {"kv_connector_extra_config": {"shared_storage_pth": "x"}}
    with pytest.raises(ValueError, match="shared_storage_pth"):
        Engine(EngineArgs(model=path, kv_transfer_config=bad_extra))
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        Engine(EngineArgs(model=path, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}))
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
        offloading_config(8), bad_extra]}}
    with pytest.raises(ValueError, match="shared_storage_pth"):
        Engine(EngineArgs(model=path, kv_transfer_config=multi))
    with pytest.raises(ValueError, match="draft model"):
        Engine(EngineArgs(model=path, kv_transfer_config=storage_config(tmp_path),
                          speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2}))


def test_delay_free_holds_blocks_until_the_connector_reports_them_sent(tiny_llama):
    path, _ = tiny_llama
    engine = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config={
        "kv_connector": "DelayingConnector", "kv_role": "kv_producer", "engine_id": "prefill-0",
        "kv_connector_module_path": "tests.helpers.kv_connectors"}))
    engine.add_request("p", REQS[0][0], _greedy(1))
    finished = []
    while not finished:
        finished = [o for o in engine.step() if o.finished]
        engine.scheduler.check_invariants()
    params = finished[0].kv_transfer_params
    assert params["remote_engine_id"] == "prefill-0" and len(params["remote_block_ids"]) == 7
    assert engine.block_pool.counts()["in_use"] == 7 and engine.has_unfinished_requests()
    run_to_completion(engine)  # the worker reports them sent: every block free


def test_llm_api_takes_the_config_as_a_dict(tiny_llama, tmp_path):
    path, _ = tiny_llama
    prompt, max_tokens = REQS[4]
    outs = []
    for _ in range(2):  # the second LLM reads what the first stored
        llm = LLM(path, **ENGINE, kv_transfer_config=storage_config(tmp_path))
        outs.append(llm.generate([prompt], _greedy(max_tokens), use_tqdm=False)[0])
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == (len(prompt) - 1) // 4 * 4


def test_adapters_and_the_base_model_never_share_stored_blocks(tiny_llama, tmp_path):
    pytest.importorskip("peft")
    path, hf = tiny_llama
    targets, rslora = ADAPTERS["all"]
    make_adapter(hf, str(tmp_path / "adapter"), targets, rslora, seed=3)
    lora = LoRARequest("all", 1, str(tmp_path / "adapter"))
    prompt, max_tokens = REQS[0]
    kwargs = dict(model=path, **ENGINE, enable_lora=True)

    def run(engine: Engine) -> dict[str, list[int]]:
        engine.add_request("base", prompt, _greedy(max_tokens))
        engine.add_request("lora", prompt, _greedy(max_tokens), lora_request=lora)
        return {k: list(v.outputs[0].token_ids) for k, v in run_to_completion(engine).items()}

    want = run(Engine(EngineArgs(**kwargs)))
    assert want["base"] != want["lora"]
    kwargs["kv_transfer_config"] = storage_config(tmp_path / "kv")
    assert run(Engine(EngineArgs(**kwargs))) == want
    assert len(stored_blocks(tmp_path / "kv")) == 2 * ((len(prompt) - 1) // 4)  # one chain each (no hits between)
    engine = Engine(EngineArgs(**kwargs))
    assert run(engine) == want
    assert engine.scheduler.stats.num_external_hit_tokens == 2 * ((len(prompt) - 1) // 4 * 4)
