"""Flags whose value is a JSON object with a fixed set of keys (vLLM's `--speculative-config`,
`--kv-events-config`, ...): one way to read them and to refuse unknown keys."""
from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

_OFF = ("", "none", "null", "off")


def json_object(value: "dict[str, Any] | str | None", cls, name: str) -> dict[str, Any] | None:
    """`value` as a dict of `cls`'s fields: a dict as is, a string parsed as JSON, None or an off word
    ("", none, null, off) -> None. `name` is the config's snake_case name, for the errors."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() in _OFF:
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--{name.replace('_', '-')} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown {name} key(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return value
