"""The step limit's policy (scheduler/step_target.py) and the --target-itl-ms value it is chosen by: `auto`
is relative to the decode step and lifted by a prompt's wait; a number keeps the fixed rule; bad values
are precise errors (argparse exits 2 on the CLI)."""
from __future__ import annotations

import argparse

import pytest

from kvserve.config import EngineArgs
from kvserve.config.scheduler import AUTO, SchedulerConfig, parse_target_itl_ms
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.step_cost import LinearStepCost
from kvserve.scheduler.step_target import (DUTY_RESTORE, ITL_RATIO, SLOWDOWN_TOLERATED, GuardDuty, prompt_slowdown,
                                           step_limit_s)


def test_parse_target_itl_ms():
    assert parse_target_itl_ms("auto") == parse_target_itl_ms(" AUTO ") == AUTO
    assert parse_target_itl_ms("150") == parse_target_itl_ms(150) == 150.0
    assert parse_target_itl_ms("0") == 0.0
    for bad in ("x", "-1", -5, "nan", None, True):
        with pytest.raises(ValueError, match="--target-itl-ms must be 'auto' or milliseconds >= 0"):
            parse_target_itl_ms(bad)
    assert SchedulerConfig(8, 64, 256, target_itl_ms="150").target_itl_ms == 150.0
    with pytest.raises(ValueError, match="target-itl-ms"):
        SchedulerConfig(8, 64, 256, target_itl_ms="fast")


def test_engine_args_default_is_auto_and_the_flag_parses(capsys):
    assert EngineArgs().target_itl_ms == AUTO
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli(parser.parse_args([])).target_itl_ms == AUTO
    assert EngineArgs.from_cli(parser.parse_args(["--target-itl-ms", "150"])).target_itl_ms == 150.0
    assert EngineArgs.from_cli(parser.parse_args(["--target-itl-ms", "auto"])).target_itl_ms == AUTO
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--target-itl-ms", "soon"])
    assert e.value.code == 2
    assert "--target-itl-ms must be 'auto' or milliseconds >= 0, got 'soon'" in capsys.readouterr().err


def test_explicit_target_is_the_value_or_twice_the_decodes():
    assert step_limit_s(150.0, 0.040) == pytest.approx(0.150)
    assert step_limit_s(150.0, 0.100) == pytest.approx(0.200)
    assert step_limit_s(150.0, 0.040, slowdown=100.0) == pytest.approx(0.150)  # no wait rule


def test_auto_is_relative_to_the_decode_step_and_grows_with_the_wait():
    assert step_limit_s(AUTO, 0.040) == pytest.approx(ITL_RATIO * 0.040)
    assert step_limit_s(AUTO, 0.400) == pytest.approx(ITL_RATIO * 0.400)  # a 10x slower machine: 10x the limit
    assert step_limit_s(AUTO, 0.040, slowdown=SLOWDOWN_TOLERATED) == pytest.approx(ITL_RATIO * 0.040)
    assert step_limit_s(AUTO, 0.040, slowdown=4 * SLOWDOWN_TOLERATED) == pytest.approx(4 * ITL_RATIO * 0.040)


def _prompt(n: int, arrival: float, streamed: bool = False) -> Request:
    r = Request(f"p{n}-{arrival}", list(range(n)), SamplingParams(max_tokens=4), max_tokens=4)
    r.metrics.arrival_time = arrival
    if streamed:
        r.metrics.first_token_time = arrival + 1.0
    return r


def test_prompt_slowdown_is_the_worst_wait_over_its_own_time():
    cost = LinearStepCost(base=0.010, per_token=0.001)     # 100 tokens alone: 110 ms; 1,000: 1.01 s
    assert prompt_slowdown(cost, [], 5.0) == 0.0
    short, long = _prompt(100, arrival=4.0), _prompt(1000, arrival=3.0)
    assert prompt_slowdown(cost, [long], 5.0) == pytest.approx(2.0 / 1.01)
    assert prompt_slowdown(cost, [long, short], 5.0) == pytest.approx(1.0 / 0.110)
    # preempted after it streamed: its first token is behind it, its wait does not count
    assert prompt_slowdown(cost, [long, _prompt(100, arrival=0.0, streamed=True)], 5.0) == pytest.approx(2.0 / 1.01)


def test_guard_duty_lifts_on_a_steady_stream_not_on_a_transient():
    duty = GuardDuty()
    for _ in range(100):                 # a long prompt chunked for 100 steps (interference's scale)
        duty.observe(True)
    assert not duty.lifted and 0.3 < duty.fraction < 0.4
    for _ in range(100):                 # then more of them, steadily: most steps have one waiting
        duty.observe(True)
    assert duty.lifted
    while duty.fraction > DUTY_RESTORE:
        assert duty.lifted               # between the two thresholds it stays as it was
        duty.observe(False)
    assert not duty.lifted
