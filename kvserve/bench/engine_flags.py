"""The command-line flags that give an EngineArgs: what a bench prints in its reproduce commands and passes to
the servers it starts (the inverse of EngineArgs.from_cli, for the fields that differ from the defaults)."""
from __future__ import annotations

import dataclasses
import json

from kvserve.config import EngineArgs


def engine_flags(args: EngineArgs) -> list[str]:
    """`kvserve serve` flags for every field of `args` that differs from EngineArgs()'s."""
    defaults, flags = EngineArgs(), []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if value == getattr(defaults, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            flags += [flag, "none"]
        elif isinstance(value, (tuple, list)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags
