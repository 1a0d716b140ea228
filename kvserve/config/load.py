"""LoadConfig: how weights are read."""
from __future__ import annotations

from dataclasses import dataclass

LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    load_format: str = "auto"
    """auto: the checkpoint's own format (safetensors folder or GGUF file); dummy: random weights of the
    config's shapes, nothing read but the config (model_loader/dummy.py)."""

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
