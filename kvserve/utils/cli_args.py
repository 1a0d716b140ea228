"""argparse flags generated from a config dataclass's fields (one source of truth for names, defaults, help)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, get_type_hints


def add_dataclass_args(cls, parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One `--flag-name` per field of `cls` (but those named in `exclude`, which a command defines its own way),
    with the field's default, type, help and choices (metadata).

    `--help` shows the default when the parser's formatter is cli_help.DefaultsHelpFormatter.

    A `tuple[str, ...]` field takes one or more values (`--flag a b`, or the flag repeated). A field whose
    metadata has a "type" is parsed by it (a value of more than one kind, like `auto` or a number)."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        flags = ("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()))
        hint = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        # NOTE: the default is appended to the help by the parser's formatter (utils/cli_help.py).
        kwargs: dict[str, Any] = {"default": default, "help": (f.metadata.get("help") or "").replace("%", "%%")}
        if hint is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if hint in (tuple[str, ...], tuple[str, ...] | None):
            parser.add_argument(*flags, nargs="+", action="extend", type=str, **kwargs)
            continue
        base = int if hint in (int, int | None) else float if hint in (float, float | None) else str
        parser.add_argument(*flags, type=f.metadata.get("type", base), choices=f.metadata.get("choices"), **kwargs)


def dataclass_from_args(cls, args: argparse.Namespace):
    """The dataclass from parsed flags; a field without a flag (excluded) keeps its default."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
