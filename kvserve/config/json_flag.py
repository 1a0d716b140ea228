"""A flag whose value is a JSON object of a config dataclass's fields (vLLM's --speculative-config,
--kv-transfer-config): the JSON text (CLI) or a dict (the Python API), with unknown keys an error."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

_OFF = ("", "none", "null", "off")


def json_object_fields(value: str | dict | None, cls, name: str) -> dict[str, Any] | None:
    """`value` as a dict of `cls`'s fields; None for None or an "off" string ("", none, null, off). ValueError
    naming `name` for text that is not a JSON object and for keys `cls` does not have."""
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
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown {name} key(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return value
