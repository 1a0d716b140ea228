"""QuantizationConfig: which weight-only quantization the decoder layers' linear weights run in."""
from __future__ import annotations

from dataclasses import dataclass

QUANTIZATIONS = ("int8", "int4", "gguf")
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    method: str | None = None
    """int8 (per-output-channel scales), int4 (group-wise min/scale), gguf (a GGUF file's Q4_0/Q4_1/Q8_0
    blocks as stored); None: the checkpoint's weights in the model dtype (a quantized GGUF file is
    dequantized)."""
    group_size: int = 128
    """int4: input columns per scale/min group (32, 64 or 128); it must divide every layer's input size."""

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.method!r}; choose one of {', '.join(QUANTIZATIONS)} "
                             "(or leave it unset for none)")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")

    def check_source(self, source) -> None:
        """Refuse `gguf` for a checkpoint that has no GGUF blocks (models.loader.ModelSource)."""
        if self.method == "gguf" and source.kind != "gguf":
            raise ValueError(f"--quantization gguf keeps a GGUF file's quantized blocks, but {source.path} is a "
                             f"{source.kind} checkpoint; use int8 or int4 (quantized at load) for it")

    def describe(self) -> str:
        if self.method is None:
            return "none"
        if self.method == "int4":
            return f"int4 (group {self.group_size})"
        return self.method
