"""utils/startup_clock.py (the server's `startup:` line and its parse) and utils/lazy_zeros.py (the CPU KV
pool's lazily backed zeros)."""
from __future__ import annotations

import time

import pytest
import torch

from kvserve.utils.lazy_zeros import lazy_zeros
from kvserve.utils.startup_clock import PhaseTimes, format_phases, parse_phases, process_age_s


def test_phases_add_up_and_keep_their_order():
    phases = PhaseTimes()
    with phases.phase("weights"):
        time.sleep(0.01)
    phases.add("kernels", 0.5)
    phases.add("weights", 1.0)
    assert list(phases.seconds) == ["weights", "kernels"]
    assert 1.01 <= phases.seconds["weights"] < 2.0


def test_the_log_line_round_trips():
    phases = {"import": 1.234, "engine import": 2.0, "kv cache": 0.0, "warm-up": 0.25, "front-end config": 3.5,
              "ready": 10.0}
    line = "2026-01-01 00:00:00,000 INFO kvserve.server: " + format_phases(phases)
    assert parse_phases(line) == {name: round(s, 2) for name, s in phases.items()}
    assert parse_phases("INFO kvserve: engine ready") is None


def test_process_age_counts_from_the_process_start():
    age = process_age_s()
    assert 0.0 < age < time.monotonic()  # this process started after boot, and before now


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float16])
def test_lazy_zeros_are_zeros_of_the_shape(dtype):
    t = lazy_zeros((3, 4, 5), dtype)
    assert t.shape == (3, 4, 5) and t.dtype == dtype and t.is_contiguous()
    assert torch.count_nonzero(t) == 0
    t[1] = 1
    assert int(t.float().sum()) == 20
    assert lazy_zeros((0, 4), dtype).shape == (0, 4)
