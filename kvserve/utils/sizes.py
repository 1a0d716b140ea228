"""Human-readable byte sizes: parse `2GiB`, `512MiB`, `80GB`, `1e9` and format them back.

NOTE: kept rather than `pydantic.ByteSize`, which reads `1e9` and `2.5e3MB` as unknown units, takes
`1K`, `1PB` and `8bit` (sizes the CLI refuses today) and formats `1.5KiB` where the CLI prints `1.50 KiB`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = ["parse_size", "format_size"]

# Keys are lower-case: units are matched case-insensitively, and the `i` alone tells
# binary (KiB = 1024) from decimal (KB = 1000) units.
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>[A-Za-z]*)\s*$")
# Far beyond any real memory; stops "1e999999" from building a million-digit integer.
_MAX_BYTES = 1 << 80


def parse_size(text: str) -> int:
    """Parse a byte size such as `2GiB`, `512MiB`, `80GB`, `1.5 TB`, `4096` or `1e9`.

    Units: `B`; decimal `KB`/`MB`/`GB`/`TB` (powers of 1000); binary `KiB`/`MiB`/`GiB`/`TiB`
    (powers of 1024); none means bytes. Units are case-insensitive. Fractions are allowed
    and the result is rounded down to whole bytes.

    Raises:
        TypeError: `text` is not a string.
        ValueError: `text` is not a non-negative number with one of the units above
            (the message quotes `text`).
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_size expects a string such as '2GiB', got {type(text).__name__}")
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(
            f"invalid size {text!r}: expected a non-negative number with an optional unit, e.g. '2GiB', '80GB', '1e9'"
        )
    unit = match.group("unit")
    multiplier = _UNITS.get(unit.lower())
    if multiplier is None:
        raise ValueError(
            f"invalid size {text!r}: unknown unit {unit!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)"
        )
    try:
        number = Decimal(match.group("number"))
    except InvalidOperation as exc:  # the regex should make this unreachable
        raise ValueError(f"invalid size {text!r}: cannot parse {match.group('number')!r}") from exc
    # Decimal keeps "0.1KB" exact (100 bytes) where float arithmetic would give 100.00000000000001.
    if number > _MAX_BYTES:  # checked before multiplying so huge exponents stay cheap
        raise ValueError(f"invalid size {text!r}: larger than 2**80 bytes")
    num_bytes = int(number * multiplier)
    if num_bytes > _MAX_BYTES:
        raise ValueError(f"invalid size {text!r}: larger than 2**80 bytes")
    return num_bytes


def format_size(num_bytes: int) -> str:
    """Format a byte count with a binary unit, e.g. `1536` -> `1.50 KiB`, `100` -> `100 B`."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    value = float(num_bytes)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")
