"""The data-parallel balancer (engine/dp_balancer.py): prefix affinity on the whole prompt's block hashes, kept
only inside the balance window; load counted from dispatch; hints that expire, are bounded, and go with a dead
engine. Also the -dp flag, the threads each engine gets, and the offline LLM's refusal."""
from __future__ import annotations

import argparse

import pytest

from kvserve.config import EngineArgs
from kvserve.engine.data_parallel import engine_args_per_rank, sum_stats
from kvserve.engine.dp_balancer import BalanceWindow, Choice, DPBalancer
from kvserve.engine.engine_loop import EngineStats

BS = 4
ALL = [True, True]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _balancer(n: int = 2, **kwargs) -> DPBalancer:
    return DPBalancer(n, BS, step_tokens=kwargs.pop("step_tokens", 1 << 30), **kwargs)


def _send(b: DPBalancer, rid: str, tokens: list[int], eligible=ALL) -> Choice:
    hashes = b.prompt_hashes(tokens)
    choice = b.choose(hashes, eligible)
    b.dispatched(rid, choice.engine, hashes, len(tokens))
    return choice


def test_idle_engines_take_turns():
    b = _balancer()
    picks = [_send(b, f"r{i}", [100 + i] * 3).engine for i in range(4)]  # shorter than a block: no key
    assert picks == [0, 1, 0, 1]


def test_a_prefix_sticks_to_its_engine_while_loads_are_balanced():
    b = _balancer()
    system = list(range(16))
    first = _send(b, "a0", system + [1, 2, 3, 4])
    assert first.reason == "load"
    b.finished("a0")
    for i in range(1, 6):  # one at a time: loads stay equal
        c = _send(b, f"a{i}", system + [i] * 5)
        assert (c.engine, c.reason, c.matched_blocks) == (first.engine, "prefix", 4)
        b.finished(f"a{i}")


def test_the_longest_prefix_wins_not_the_first_blocks():
    """Two conversations sharing a system prompt: the one whose whole history one engine served goes there."""
    b = _balancer()
    system = list(range(8))
    _send(b, "x", system + [50] * 8, [True, False])   # engine 0: the system prompt + conversation x
    _send(b, "y", system + [60] * 8, [False, True])   # engine 1: the same system prompt + conversation y
    b.finished("x"), b.finished("y")
    assert b.affinity(b.prompt_hashes(system + [50] * 8 + [51] * 4)) == (0, 4)
    assert b.affinity(b.prompt_hashes(system + [60] * 8 + [61] * 4)) == (1, 4)


def test_affinity_ends_past_the_window_so_a_burst_does_not_herd():
    b = _balancer(window=BalanceWindow(abs_threshold=2, rel_threshold=1.5))
    prefix = list(range(12))
    picks = [_send(b, f"r{i}", prefix + [i]).engine for i in range(20)]  # none finishes
    loads = b.loads()
    assert min(picks.count(0), picks.count(1)) >= 8, picks
    assert max(loads) - min(loads) <= 3 and max(loads) <= 1.5 * min(loads) + 3, loads


def test_waiting_prompt_tokens_count_until_the_first_output():
    b = _balancer(step_tokens=8)
    _send(b, "long", list(range(40)))
    assert b.loads() == [1 + 40 / 8, 0]
    b.started("long")
    assert b.loads() == [1, 0]
    b.finished("long")
    assert b.loads() == [0, 0]


def test_a_full_or_dead_engine_is_not_chosen_and_a_dead_engine_loses_its_hints():
    b = _balancer()
    prefix = list(range(12))
    assert _send(b, "a", prefix + [1] * 4, [True, False]).engine == 0
    assert _send(b, "b", prefix + [2] * 4, [False, True]).engine == 1  # engine 0 full: its prefix does not matter
    assert b.affinity(b.prompt_hashes(prefix)) == (1, 3)  # the latest dispatch owns the shared blocks
    b.engine_died(1)
    assert b.loads()[1] == 0
    assert b.affinity(b.prompt_hashes(prefix + [2] * 4)) == (None, 0)  # engine 1's entries went with it
    assert b.affinity(b.prompt_hashes(prefix + [1] * 4)) == (0, 4)
    with pytest.raises(ValueError, match="no engine"):
        b.choose([], [False, False])


def test_hints_expire_and_are_bounded():
    clock = Clock()
    b = _balancer(ttl_s=10, max_entries=6, clock=clock)
    _send(b, "a", list(range(16)), [True, False])
    assert b.affinity(b.prompt_hashes(list(range(16))))[0] == 0
    clock.t = 11
    assert b.affinity(b.prompt_hashes(list(range(16)))) == (None, 0)
    _send(b, "b", list(range(100, 116)))
    assert b.num_prefix_entries == 6  # 4 + 4 blocks, the oldest dropped first
    assert b.affinity(b.prompt_hashes(list(range(100, 116))))[1] == 4


def test_balance_window_validates():
    with pytest.raises(ValueError):
        BalanceWindow(rel_threshold=0.5)
    with pytest.raises(ValueError, match="data_parallel_balance"):
        EngineArgs(model="x", data_parallel_balance_rel_threshold=0.9)


def test_dp_flag_threads_and_the_offline_refusal():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli(parser.parse_args(["--model", "m", "-dp", "2", "-tp", "1", "--num-threads", "5"]))
    assert args.data_parallel_size == 2
    rank = engine_args_per_rank(args)
    assert (rank.data_parallel_size, rank.num_threads) == (1, 2)
    assert engine_args_per_rank(EngineArgs(model="m", data_parallel_size=4), total_threads=2).num_threads == 1
    with pytest.raises(ValueError, match="data_parallel_size must be"):
        EngineArgs(model="m", data_parallel_size=0)
    with pytest.raises(ValueError, match="kvserve serve --data-parallel-size"):
        args.create_engine_config()


def test_stats_sum_over_engines():
    a = EngineStats(num_running=2, kv_cache_usage=0.5, num_kv_blocks_total=10, num_spec_accepted_per_pos_total=(1, 2))
    b = EngineStats(num_running=1, kv_cache_usage=0.0, num_kv_blocks_total=30, num_spec_accepted_per_pos_total=(3,))
    total = sum_stats([a, b])
    assert (total.num_running, total.num_kv_blocks_total, total.kv_cache_usage) == (3, 40, 0.125)
    assert total.num_spec_accepted_per_pos_total == (4, 2)
