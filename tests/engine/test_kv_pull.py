"""The pull connector (PullConnector, vLLM's NixlConnector name): a prefill engine and a decode engine in one
process over the TCP side channel. Greedy tokens of prefill -> decode equal transformers' (or one engine's, for a
quantized cache) over prompts with local prefix hits on the decode side and chunked prefill; the faults (an
unreachable or dropping prefill instance, a corrupt transfer, an expired lease, an abort while pulling) recompute
or fail per kv_load_failure_policy. Block invariants on both engines after every step; every block free on both
at the end."""
from __future__ import annotations

import pytest

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from tests.helpers.kv_pull import assert_all_blocks_free, disaggregated, greedy, pull_config, step_all
from tests.helpers.oracles import hf_greedy

# block 4, 16 tokens a step: prompts are chunked on both sides; 5 and 6 share a prefix with 4 (a local hit on
# the decode side once 4 ran there), 7 is shorter than a block.
ENGINE = dict(block_size=4, num_gpu_blocks_override=64, max_num_batched_tokens=16)
_SHARED = list(range(300, 322))
REQS = [(list(range(100, 126)), 8), (list(range(900, 913)), 6), (list(range(200, 237)), 5), (list(range(40, 56)), 4),
        (_SHARED + [7, 8, 9], 6), (_SHARED + [11, 12], 6), (_SHARED + [13], 3), ([5, 6, 7], 4)]


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
    assert all(v.num_cached_tokens == len(p) - 1 for v, (p, _) in zip((rest[str(i)] for i in (5, 6)), REQS[5:7]))
    assert_all_blocks_free(prefill, decode)


def test_response_carries_vllm_kv_transfer_params(tiny_llama):
    path, _ = tiny_llama
    prefill = Engine(EngineArgs(model=path, **ENGINE, kv_transfer_config=pull_config("kv_producer") | {
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
