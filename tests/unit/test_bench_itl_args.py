"""`kvserve bench itl`'s arguments: the settings compared by default (the new default, the former one, the
fixed budget), `auto` in --targets, and --cpu-isa's restart environment."""
from __future__ import annotations

import pytest

from kvserve.bench.itl import parse_targets, restart_env
from kvserve.utils.cpu_isa import emulation_env, supported_isas


def test_default_settings_are_auto_the_former_default_and_the_fixed_budget():
    assert parse_targets(None, "auto") == ["auto", 150.0, 0.0]
    assert parse_targets(None, 0.0) == ["auto", 150.0, 0.0]
    assert parse_targets(None, 150.0) == [150.0, 0.0]
    assert parse_targets(None, 90.0) == [90.0, 150.0, 0.0]
    assert parse_targets("auto, 200,0", "auto") == ["auto", 200.0, 0.0]
    for bad in ("x", "-1", ",", "auto,fast"):
        with pytest.raises(ValueError, match="--targets"):
            parse_targets(bad, "auto")


def test_cpu_isa_restarts_only_when_not_in_place():
    isa = supported_isas()[-1]
    assert restart_env(None, {}) is None
    env = restart_env(isa, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", **emulation_env(isa)}
    assert restart_env(isa, env) is None   # the restarted process runs on
    unsupported = [i for i in ("avx512", "avx2", "scalar") if i not in supported_isas()]
    for i in unsupported:
        with pytest.raises(ValueError, match="this CPU cannot run it"):
            restart_env(i, {})
