"""The pull connector (PullConnector, vLLM's NixlConnector name): a prefill engine and a decode engine in one
process over the TCP side channel. Greedy tokens of prefill -> decode equal transformers' (or one engine's, for a
quantized cache) over prompts with local prefix hits on the decode side and chunked prefill; the faults (an
unreachable or dropping prefill instance, a corrupt transfer, an expired lease, an abort while pulling) recompute
or fail per kv_load_failure_policy. Block invariants on both engines after every step; every block free on both
at the end."""
from __future__ import annotations

import dataclasses
import threading

import pytest

from kvserve import LoRARequest
from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.kv_transfer.connectors import pull_transport
from kvserve.request import RequestStatus
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers.kv_pull import assert_all_blocks_free, disaggregated, greedy, pull_config, step_all
from tests.helpers.lora import ADAPTERS, make_adapter
from tests.helpers.oracles import hf_greedy

# block 4, 16 tokens a step: prompts are chunked on both sides; 5 and 6 share a prefix with 4 (a local hit on
# the decode side once 4 ran there: they pull only their last block), 7 is shorter than a block, 8 is 4 again
# (all but its last token cached on the decode side: nothing to pull, the prefill side is only told to free).
ENGINE = dict(block_size=4, num_gpu_blocks_override=64, max_num_batched_tokens=16)
_SHARED = list(range(300, 322))
REQS = [(list(range(100, 126)), 8), (list(range(900, 913)), 6), (list(range(200, 237)), 5), (list(range(40, 56)), 4),
        (_SHARED + [7, 8, 9], 6), (_SHARED + [11, 12], 6), (_SHARED + [13], 3), ([5, 6, 7], 4),
        (_SHARED + [7, 8, 9], 2)]


def _pair(path, policy="recompute", connector="PullConnector", prefill_extra=None, decode_extra=None, **kwargs):
    prefill = Engine(EngineArgs(model=path, **ENGINE, **kwargs, kv_transfer_config=pull_config(
        "kv_producer", policy, connector, **(prefill_extra or {}))))
    decode = Engine(EngineArgs(model=path, **ENGINE, **kwargs, kv_transfer_config=pull_config(
        "kv_consumer", policy, connector, **(decode_extra or {}))))
    return prefill, decode


def _tokens(done: dict) -> dict[str, list[int]]:
    return {k: list(v.outputs[0].token_ids) for k, v in done.items()}


def _assert_hf(done: dict, reqs, hf) -> None:
    for i, (prompt, max_tokens) in enumerate(reqs):
        out = done[str(i)].outputs[0]
        assert out.finish_reason == "length", out
        assert list(out.token_ids) == hf_greedy(hf, prompt, max_tokens)[0], f"request {i} differs"


@pytest.mark.parametrize("connector", ["PullConnector", "NixlConnector"])
def test_prefill_then_decode_matches_hf(tiny_llama, connector):
    path, hf = tiny_llama
    prefill, decode = _pair(path, connector=connector)
    first = disaggregated(prefill, decode, REQS[:5])
    _assert_hf(first, REQS[:5], hf)
    pulled = decode.scheduler.stats.num_external_hit_tokens
    assert pulled == sum(len(p) - 1 for p, _ in REQS[:5]), pulled
    # 5 and 6 find 4's prompt in the decode side's prefix cache: only what it misses is pulled
    rest = disaggregated(prefill, decode, REQS[5:], ids=[str(i) for i in range(5, len(REQS))])
    _assert_hf(first | rest, REQS, hf)
    assert decode.scheduler.stats.num_prefix_hit_tokens > 0
    stats = decode.core.executor.worker.runner.kv_connector.connector.transfer_stats()
    assert stats["num_pulled"] == len(REQS) - 1 and stats["bytes"] > 0  # 8 pulled nothing, only said so
    assert all(rest[str(i)].num_cached_tokens == len(REQS[i][0]) - 1 for i in range(5, len(REQS)))
    assert_all_blocks_free(prefill, decode)


@pytest.mark.parametrize("engine_kwargs", [dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8_e4m3"),
                                           dict(dtype="bfloat16")], ids=["int8", "fp8", "bf16"])
def test_every_kv_cache_dtype_matches_one_engine(tiny_llama, engine_kwargs):
    """The oracle computes the same way on one engine: the prompt (chunked), then its last token alone over the
    cached prompt. One request at a time: a coarse cache turns the batch's rounding into other tokens."""
    path, _ = tiny_llama
    one = Engine(EngineArgs(model=path, **ENGINE, **engine_kwargs))
    prefill, decode = _pair(path, **engine_kwargs)
    for i, (prompt, max_tokens) in enumerate(REQS[:4]):
        one.add_request(f"cache-{i}", prompt, greedy(1))
        step_all([one], None)
        one.add_request(str(i), prompt, greedy(max_tokens))
        want = _tokens(step_all([one], None))
        one.scheduler.kv.reset_prefix_cache()
        assert _tokens(disaggregated(prefill, decode, [(prompt, max_tokens)], ids=[str(i)])) == want
        decode.scheduler.kv.reset_prefix_cache()
    assert decode.scheduler.stats.num_kv_load_failures == 0
    # a quantized cache's partial last block is computed on the decode side (its scales follow how it was written)
    bs = ENGINE["block_size"]
    pulled = [len(p) - 1 - ((len(p) - 1) % bs if "kv_cache_dtype" in engine_kwargs else 0) for p, _ in REQS[:4]]
    assert decode.scheduler.stats.num_external_hit_tokens == sum(pulled)
    assert_all_blocks_free(prefill, decode)


def test_decode_side_preemption_after_a_pull(tiny_llama):
    path, hf = tiny_llama
    prefill = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=pull_config("kv_producer")))
    decode = Engine(EngineArgs(model=path, **(ENGINE | dict(num_gpu_blocks_override=24)),
                               kv_transfer_config=pull_config("kv_consumer")))
    reqs = [(p, 12) for p, _ in REQS[:5]]
    _assert_hf(disaggregated(prefill, decode, reqs), reqs, hf)
    assert decode.scheduler.stats.num_preemptions > 0
    assert_all_blocks_free(prefill, decode)


def test_response_carries_vllm_kv_transfer_params_and_an_unread_lease_expires(tiny_llama):
    path, _ = tiny_llama
    prefill = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=pull_config("kv_producer", lease_s=0.3) | {
        "engine_id": "prefill-7"}))
    prompt = REQS[0][0]
    prefill.add_request("r", prompt, greedy(1, {"do_remote_decode": True}))
    done = step_all([prefill], lambda d: "r" in d)
    params = done["r"].kv_transfer_params
    port = prefill.core.kv_connector.side_channel[1]
    assert params == {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_block_ids": params["remote_block_ids"], "remote_engine_id": "prefill-7",
                      "remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "r", "tp_size": 1}
    assert len(params["remote_block_ids"]) == 7 and port > 0
    assert prefill.block_pool.counts()["in_use"] == 7  # held until read or the lease expires
    # a request without do_remote_decode frees its blocks as usual
    prefill.add_request("plain", prompt, greedy(1))
    plain = step_all([prefill], lambda d: "plain" in d)["plain"]
    assert plain.kv_transfer_params is None
    step_all([prefill], None)  # nobody reads "r": its lease frees its blocks
    assert_all_blocks_free(prefill)


def _assert_failed(done: dict, ids) -> None:
    for i in ids:
        out = done[i].outputs[0]
        assert out.finish_reason == "error" and list(out.token_ids) == [], out
        assert "kv_load_failure_policy is 'fail'" in out.error, out.error


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_instance_gone_after_answering(tiny_llama, policy):
    path, hf = tiny_llama
    prefill, decode = _pair(path, policy, prefill_extra={"lease_s": 0.5})
    reqs = REQS[:2]

    def kill_prefill_side_channel(req_id, params):
        prefill.core.executor.worker.shutdown_kv_connector()
        return params

    done = disaggregated(prefill, decode, reqs, params_of=kill_prefill_side_channel)
    assert decode.scheduler.stats.num_kv_load_failures == 2
    if policy == "recompute":
        _assert_hf(done, reqs, hf)
    else:
        _assert_failed(done, ["0", "1"])
    assert_all_blocks_free(prefill, decode)  # the prefill side's leases freed its blocks


def _faulty_send(monkeypatch, fault: str) -> None:
    """The side channel drops (half a block, then the connection) or corrupts (a byte of each block) every read."""
    real = pull_transport.send_block

    def send(sock, data):
        if fault == "corrupt":
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0xFF
            return real(sock, memoryview(flipped))
        real(sock, data[:len(data) // 2])
        raise OSError("the prefill instance died mid-transfer")

    monkeypatch.setattr(pull_transport, "send_block", send)


@pytest.mark.parametrize("fault", ["drop", "corrupt"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_dropped_or_corrupt_transfer(tiny_llama, monkeypatch, fault, policy):
    path, hf = tiny_llama
    prefill, decode = _pair(path, policy, prefill_extra={"lease_s": 0.5})
    _faulty_send(monkeypatch, fault)
    done = disaggregated(prefill, decode, REQS[:2])
    assert decode.scheduler.stats.num_kv_load_failures == 2
    if policy == "recompute":
        _assert_hf(done, REQS[:2], hf)
    else:
        _assert_failed(done, ["0", "1"])
    assert_all_blocks_free(prefill, decode)


def test_lease_expired_before_the_read_recomputes(tiny_llama):
    path, hf = tiny_llama
    prefill, decode = _pair(path, prefill_extra={"lease_s": 0.2})

    def after_the_lease(req_id, params):
        step_all([prefill], None)  # nobody read it in time: the prefill side freed the blocks
        assert prefill.block_pool.counts()["in_use"] == 0
        return params

    done = disaggregated(prefill, decode, REQS[:1], params_of=after_the_lease)
    _assert_hf(done, REQS[:1], hf)
    assert decode.scheduler.stats.num_kv_load_failures == 1
    assert_all_blocks_free(prefill, decode)


def _hanging_reads(monkeypatch) -> threading.Event:
    """The side channel answers no read until the returned event is set."""
    release = threading.Event()
    real = pull_transport.BlockServer._read

    def read(self, sock, request_id, block_ids):
        release.wait(30)
        return real(self, sock, request_id, block_ids)

    monkeypatch.setattr(pull_transport.BlockServer, "_read", read)
    return release


def test_abort_while_pulling_frees_the_blocks(tiny_llama, monkeypatch):
    path, _ = tiny_llama
    prefill, decode = _pair(path, prefill_extra={"lease_s": 1.0})
    release = _hanging_reads(monkeypatch)
    try:
        prompt = REQS[0][0]
        prefill.add_request("p", prompt, greedy(1, {"do_remote_decode": True}))
        params = step_all([prefill], lambda d: "p" in d)["p"].kv_transfer_params
        decode.add_request("d", prompt, greedy(4, params))
        step_all([decode], lambda d: decode.scheduler.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        assert decode.block_pool.counts()["in_use"] == 7
        decode.abort_request("d")
        assert "d" in decode.scheduler.kv_held  # the pull may still write them: held until it stops
        done = step_all([prefill, decode], None)
        assert done["d"].outputs[0].finish_reason == "abort"
    finally:
        release.set()
    assert_all_blocks_free(prefill, decode)


def test_a_pull_never_waits_past_its_timeout(tiny_llama, monkeypatch):
    path, hf = tiny_llama
    prefill, decode = _pair(path, prefill_extra={"lease_s": 1.0}, decode_extra={"timeout_s": 0.3})
    release = _hanging_reads(monkeypatch)
    try:
        done = disaggregated(prefill, decode, REQS[:1])
    finally:
        release.set()
    _assert_hf(done, REQS[:1], hf)
    assert decode.scheduler.stats.num_kv_load_failures == 1
    assert_all_blocks_free(prefill, decode)


def test_multi_connector_with_the_pull_connector(tiny_llama):
    path, hf = tiny_llama

    def multi(role):
        return {"kv_connector": "MultiConnector", "kv_role": role, "kv_connector_extra_config": {"connectors": [
            pull_config(role), {"kv_connector": "OffloadingConnector",
                                "kv_connector_extra_config": {"num_cpu_blocks": 32}}]}}

    prefill = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=multi("kv_producer")))
    decode = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=multi("kv_both")))
    _assert_hf(disaggregated(prefill, decode, REQS[:3]), REQS[:3], hf)
    assert decode.scheduler.stats.num_external_hit_tokens == sum(len(p) - 1 for p, _ in REQS[:3])
    assert decode.core.kv_connector.connectors[1].num_external_hit_tokens == 0  # the pull served every hit
    worker_pull = decode.core.executor.worker.runner.kv_connector.connector.connectors[0]
    assert worker_pull.transfer_stats()["num_pulled"] == 3
    assert_all_blocks_free(prefill, decode)


def test_another_kv_layout_is_a_load_error(tiny_llama):
    path, hf = tiny_llama
    prefill = Engine(EngineArgs(model=path, **ENGINE, kv_cache_dtype="int8",
                                kv_transfer_config=pull_config("kv_producer")))
    decode = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=pull_config("kv_consumer")))
    _assert_hf(disaggregated(prefill, decode, REQS[:1]), REQS[:1], hf)  # recomputed on the decode side
    assert decode.scheduler.stats.num_kv_load_failures == 1
    assert_all_blocks_free(prefill, decode)


def test_bad_configs_fail_at_start_up(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="lease_s must be a positive number"):
        Engine(EngineArgs(model=path, kv_transfer_config=pull_config("kv_both", lease_s=0)))
    with pytest.raises(ValueError, match="'lease'"):
        Engine(EngineArgs(model=path, kv_transfer_config=pull_config("kv_both", lease=5)))
    taken = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=pull_config("kv_producer")))
    port = taken.core.kv_connector.side_channel[1]
    with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
        Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=pull_config("kv_producer") | {"kv_port": port}))


def test_producers_on_one_host_left_at_the_default_port(tiny_llama):
    path, _ = tiny_llama
    default = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    engines = [Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=default)) for _ in range(2)]
    ports = {engine.core.kv_connector.side_channel[1] for engine in engines}
    for engine in engines:
        engine.shutdown()  # frees the ports
    assert len(ports) == 2  # the second (or both, if a process holds 14579) took a free port


def _fifty_requests(lora) -> list[tuple[str, list[int], SamplingParams, object]]:
    """50 requests: groups sharing prefixes, prompts from 2 to 45 tokens (some repetitive, for ngram drafts),
    every fifth with a LoRA adapter, every seventh constrained to a regex."""
    out = []
    for i in range(50):
        group = list(range(400 + 50 * (i % 6), 400 + 50 * (i % 6) + 12 + 3 * (i % 4)))
        tail = [7, 8, 9] * (i % 5) if i % 3 == 0 else list(range(1000 + i, 1000 + i + i % 11))
        prompt = (group + tail)[:2 + (i * 7) % 44] if i % 10 == 9 else group + tail
        structured = StructuredOutputsParams(regex="[a-z ]{1,12}") if i % 7 == 3 else None
        params = SamplingParams(temperature=0, max_tokens=3 + i % 6, ignore_eos=structured is None,
                                structured_outputs=structured)
        out.append((str(i), prompt, params, lora if i % 5 == 1 else None))
    return out


def test_fifty_requests_with_lora_ngram_structured_outputs_and_preemption(tiny_llama, tmp_path):
    """One engine's tokens (the other tests hold each feature to transformers), over a decode pool small enough
    to preempt, with ngram speculation, a LoRA adapter and structured outputs."""
    pytest.importorskip("peft")
    path, hf = tiny_llama
    make_adapter(hf, str(tmp_path / "adapter"), *ADAPTERS["attn"], seed=5)
    lora = LoRARequest("attn", 1, str(tmp_path / "adapter"))
    common = dict(model=path, block_size=4, max_num_batched_tokens=32, enable_lora=True, max_loras=2,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    reqs = _fifty_requests(lora)
    one = Engine(EngineArgs(**common, num_gpu_blocks_override=256))
    for req_id, prompt, params, adapter in reqs:
        one.add_request(req_id, prompt, params, lora_request=adapter)
    want = _tokens(step_all([one], None))
    prefill = Engine(EngineArgs(**common, num_gpu_blocks_override=256, kv_transfer_config=pull_config("kv_producer")))
    decode = Engine(EngineArgs(**common, num_gpu_blocks_override=40, kv_transfer_config=pull_config("kv_consumer")))
    for req_id, prompt, params, adapter in reqs:
        prefill.add_request(f"prefill-{req_id}", prompt, greedy(1, {"do_remote_decode": True}), lora_request=adapter)
    answers = step_all([prefill], lambda d: len(d) == len(reqs))
    for req_id, prompt, params, adapter in reqs:
        params = dataclasses.replace(params, extra_args={
            "kv_transfer_params": answers[f"prefill-{req_id}"].kv_transfer_params})
        decode.add_request(req_id, prompt, params, lora_request=adapter)
    got = _tokens({k: v for k, v in step_all([prefill, decode], None).items() if not k.startswith("prefill-")})
    assert got == want
    stats = decode.scheduler.stats
    assert stats.num_preemptions > 0 and stats.num_external_hit_tokens > 0 and stats.num_kv_load_failures == 0
    assert_all_blocks_free(prefill, decode)
