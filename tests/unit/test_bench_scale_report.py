"""`kvserve bench scale`'s arithmetic without a server: the best possible prefix hit rate of a workload over R
replicas, the measured one from the replicas' counters, load skew, the KV transfer's share of TTFT, the replicas'
KV capacity, the packaged workloads, and the report's target lines."""
from __future__ import annotations

import math

import pytest

from kvserve.bench.scale import SECTIONS, _parse, add_arguments, format_report
from kvserve.bench.scale_report import (best_hit_rate, load_skew, max_private_tokens, measured_hit_rate,
                                        routing_lines, transfer_share)
from kvserve.bench.scale_routing import replica_blocks
from kvserve.bench.scale_workloads import group_of, load_chat, load_groups

BS = 4


def test_a_group_prefix_is_computed_once_on_one_replica():
    prefix = list(range(100, 108))                       # 2 blocks
    prompts = [prefix + [i, i + 1, i + 2] for i in (1, 5, 9, 13)]  # 11 tokens: 2 hittable blocks each
    best = best_hit_rate(prompts, BS, num_replicas=2)
    # each prefix block is in 4 of 4 requests: past half the traffic, both replicas hold it
    assert best.hit_tokens == 2 * (4 - 2) * BS and best.query_tokens == 44 and best.blocks_to_hold == 4
    one = best_hit_rate(prompts, BS, num_replicas=1)
    assert one.hit_tokens == 2 * 3 * BS and one.blocks_to_hold == 2
    assert math.isclose(one.rate, 24 / 44)


def test_groups_that_each_take_a_quarter_of_the_traffic_need_one_replica_each():
    groups = [[list(range(g * 100, g * 100 + 8)) + [g * 100 + 50 + i] for i in range(3)] for g in range(4)]
    prompts = [p for group in groups for p in group]      # 9 tokens: 2 hittable blocks
    best = best_hit_rate(prompts, BS, num_replicas=2)
    assert best.hit_tokens == 4 * 2 * (3 - 1) * BS and best.blocks_to_hold == 8
    assert best == best_hit_rate(prompts, BS, num_replicas=1)


def test_a_prompts_last_full_block_is_cached_for_the_next_one():
    first = list(range(8))  # its second block is computed (the last token must be), then cached
    assert best_hit_rate([first, first + [50, 51, 52]], BS, 1).hit_tokens == 2 * BS


def test_the_last_token_is_never_a_hit_and_unique_prompts_hit_nothing():
    exact = list(range(8))  # 2 full blocks: only the first is hittable (the last token is computed)
    assert best_hit_rate([exact, exact], BS, 1).hit_tokens == BS
    assert best_hit_rate([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], BS, 1).hit_tokens == 0


def test_a_cache_too_small_keeps_the_blocks_worth_the_most_hits():
    hot = [list(range(100, 108)) + [i] for i in range(5)]     # 2 blocks, used 5 times
    cold = [list(range(200, 208)) + [i] for i in range(2)]    # 2 blocks, used twice
    prompts = hot + cold
    assert best_hit_rate(prompts, BS, 1).hit_tokens == (4 + 1) * 2 * BS
    small = best_hit_rate(prompts, BS, 1, capacity_blocks=2)
    assert small.hit_tokens == 4 * 2 * BS and small.blocks_to_hold == 2
    assert best_hit_rate(prompts, BS, 1, capacity_blocks=1).hit_tokens == 4 * BS  # the parent, not its child


def test_private_tokens_are_past_the_shared_blocks():
    prefix = list(range(100, 108))
    prompts = [prefix + list(range(i * 10, i * 10 + 6)) for i in range(3)]
    assert max_private_tokens(prompts, BS) == 6
    assert max_private_tokens([list(range(9))], BS) == 9


def test_replica_blocks_hold_half_the_reused_blocks_and_the_requests_in_flight():
    prefixes = [list(range(g * 100, g * 100 + 16)) for g in range(4)]         # 4 blocks each, 16 reused
    prompts = [p + [g * 100 + 90 + i, 7] for g, p in enumerate(prefixes) for i in range(2)]
    # 8 reused blocks per replica; in flight: 2 private tokens + 3 output tokens -> 2 blocks, + 1 partial
    assert replica_blocks(prompts, 3, BS, concurrency=2) == 8 + 2 * 3
    assert replica_blocks(prompts, 3, BS, concurrency=2, share=0.25) == 4 + 2 * 3


def test_measured_hit_rate_is_token_weighted_over_replicas():
    deltas = [{"kvserve:prefix_cache_hits_total": 30.0, "kvserve:prefix_cache_queries_total": 100.0},
              {"kvserve:prefix_cache_hits_total": 10.0, "kvserve:prefix_cache_queries_total": 300.0}]
    assert measured_hit_rate(deltas) == 0.1
    assert measured_hit_rate([{}]) == 0.0


def test_load_skew():
    assert load_skew([6, 4]) == 1.5 and load_skew([5, 5]) == 1.0
    assert load_skew([3, 0]) == math.inf and load_skew([0, 0]) == 1.0


def test_transfer_share_counts_the_save_and_the_load():
    share = transfer_share(producer_ttft_s=1.1, compute_ttft_s=1.0, consumer_ttft_s=0.05)
    assert math.isclose(share["save_s"], 0.1) and math.isclose(share["ttft_s"], 1.15)
    assert math.isclose(share["share"], 0.15 / 1.15)
    assert transfer_share(0.9, 1.0, 0.1)["save_s"] == 0.0  # a faster producer saved nothing measurable


def test_the_packaged_workloads():
    groups = load_groups()
    assert len(groups) == 64 and len({group_of(r) for r in groups}) == 8
    rounds = [[group_of(r) for r in groups[i:i + 8]] for i in range(0, 64, 8)]
    assert all(sorted(r) == list(range(8)) for r in rounds) and len({tuple(r) for r in rounds}) > 1
    # round robin over 2 replicas sends some group to both
    assert any(len({i % 2 for i, r in enumerate(groups) if group_of(r) == g}) == 2 for g in range(8))
    assert len(load_groups(4, 4)) == 16
    best = best_hit_rate([r.prompt_token_ids for r in groups], 16, 2)
    assert best.rate > 0.7
    chat = load_chat()
    assert len(chat) == 32 and [r.turn for r in chat[:8]] == [0] * 8
    assert [r.conversation for r in chat[:8]] != [r.conversation for r in chat[8:16]]
    last = max((r for r in chat if r.conversation == 0), key=lambda r: r.turn)
    first = min((r for r in chat if r.conversation == 0), key=lambda r: r.turn)
    assert last.messages[:len(first.messages)] == first.messages  # a turn repeats the ones before it
    assert len({r.messages[0]["content"] for r in chat}) == 1       # one system prompt for everyone
    assert len(load_chat(4, 3)) == 12


def _section(precise: float, cache_aware: float, best: float, skew: float) -> dict:
    ttft = {"median_ms": 10.0, "p99_ms": 20.0}
    return {"balance_rel_threshold": 1.5, "replica_blocks": 10, "block_size": 16, "concurrency": 4, "workloads": {
        "groups": {"best_hit_rate": best, "best_one_engine": best, "capacity_ok": True, "policies": {
            "cache_aware": {"hit_rate": cache_aware, "ttft": ttft, "skew": 1.0},
            "precise": {"hit_rate": precise, "ttft": ttft, "skew": skew},
            "one engine (2 threads)": {"hit_rate": best, "ttft": ttft}}}}}


def test_routing_targets_are_printed_met_or_not():
    met = "\n".join(routing_lines(_section(precise=0.79, cache_aware=0.7, best=0.8, skew=1.2)))
    assert "1.0 points below the best, +9.0 against cache_aware: met" in met
    assert "worst 1.20: met" in met
    missed = "\n".join(routing_lines(_section(precise=0.75, cache_aware=0.76, best=0.8, skew=2.0)))
    assert "5.0 points below the best" in missed and missed.count("NOT met") == 2


def test_report_says_when_disaggregation_was_not_measured():
    itl = {"median_ms": 10.0, "p99_ms": 12.0}
    report = {"quick": True, "pinning": "pinned", "a": {
        "colocated": {"itl": itl, "itl_no_prefill": itl, "itl_p99_ratio": 1.0, "long_ttft": itl},
        "disaggregated": {"skipped": "`kvserve proxy` is not available here"}}}
    text = "\n".join(format_report(report))
    assert "`kvserve proxy` is not available here" in text and "p99 ratio" in text and ": n/a" in text


def test_flags_are_checked():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert _parse(parser.parse_args([]))[0] == list(SECTIONS)
    assert _parse(parser.parse_args(["--sections", "b"]))[:2] == (["b"], ["round_robin", "cache_aware", "precise"])
    for bad in (["--sections", "x"], ["--policies", "nope"], ["--kv-connector-extra-config", "[1]"],
                ["--concurrency", "0"], ["--replica-kv-share", "0"]):
        with pytest.raises(ValueError):
            _parse(parser.parse_args(bad))


def test_report_of_the_transfer_section():
    c = {"prompt_tokens": 2000, "producer_ttft_s": 1.1, "consumer_ttft_s": 0.05, "compute_ttft_s": 1.0,
         "runs": [{}] * 3, "bytes_per_token": 47000.0, "pool_bytes_per_token": 46080.0, "loaded_tokens": 1984,
         **transfer_share(1.1, 1.0, 0.05)}
    text = "\n".join(format_report({"quick": False, "pinning": "pinned", "c": c}))
    assert "13.0% of the disaggregated TTFT" in text and "47000 B/token written" in text
    assert "took 1984 of the 2000 prompt tokens" in text and "<= 5% of TTFT for a 2k-token prompt: NOT met" in text
