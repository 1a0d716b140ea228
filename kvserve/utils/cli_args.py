"""argparse flags generated from a config dataclass's fields (one source of truth for names, defaults, help)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, get_type_hints


def add_dataclass_args(cls, parser: argparse.ArgumentParser) -> None:
    """One `--flag-name` per field of `cls`, with the field's default, type, help and choices (metadata)."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata.get("help")}
        if hint is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        base = int if hint in (int, int | None) else float if hint in (float, float | None) else str
        parser.add_argument(flag, type=base, choices=f.metadata.get("choices"), **kwargs)


def dataclass_from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
