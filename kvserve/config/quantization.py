"""QuantizationConfig: which weight-only quantization the decoder layers' linear weights run in."""
from __future__ import annotations

from dataclasses import dataclass

QUANTIZATIONS = ("int8", "int4", "gguf")
GROUP_SIZES = (32, 64, 128)
INT4_GROUP_SIZES = GROUP_SIZES
PER_CHANNEL = -1
"""--quantization-group-size -1: int8 with one scale per output channel (GPTQ's `group_size: -1`)."""
DEFAULT_GROUP_SIZE = {"int8": 32, "int4": 128}
"""int8's group 32 is the Q8_0 layout (docs/features/quantization.md: it meets the 97% top-1 target where one scale
per channel does not); int4's 128 is the usual GPTQ/AWQ group."""
LM_HEAD_GROUP_SIZE = 32
"""The quantized LM head is int8 with a scale per 32 inputs: llama.cpp's Q8_0, the type GGUF files (the
built-in one included) store the tied embedding / output matrix in, so requantizing it finds the same codes."""


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    method: str | None = None
    """int8 (symmetric, a scale per group of inputs or per output channel), int4 (group-wise min/scale), gguf (a
    GGUF file's Q4_0/Q4_1/Q8_0 blocks as stored); None: the checkpoint's weights in the model dtype (a quantized
    GGUF file is dequantized)."""
    group_size: int | None = None
    """Input columns per scale group: 32, 64 or 128 (it must divide every layer's input size), or -1 for one
    scale per output channel (int8 only); None: DEFAULT_GROUP_SIZE of the method."""
    lm_head: bool = True
    """With a method set, the LM head runs int8 with LM_HEAD_GROUP_SIZE groups (it is read every token: in
    float32 SmolLM2's tied 49152 x 576 head is as many bytes as all its int8 decoder layers); False keeps it in
    the model dtype."""

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.method!r}; choose one of {', '.join(QUANTIZATIONS)} "
                             "(or leave it unset for none)")
        g = self.group_size
        if g == PER_CHANNEL and self.method not in (None, "int8"):
            raise ValueError(f"quantization_group_size -1 (one scale per output channel) is for int8 only, "
                             f"not {self.method}; choose one of {GROUP_SIZES}")
        if g is not None and g != PER_CHANNEL and g not in GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {GROUP_SIZES} (or -1: per channel, int8), "
                             f"got {g}")

    @property
    def group(self) -> int:
        """The group size in effect for `method` (PER_CHANNEL for per-channel int8; gguf: the file's, unused)."""
        if self.group_size is not None:
            return self.group_size
        return DEFAULT_GROUP_SIZE.get(self.method or "", DEFAULT_GROUP_SIZE["int4"])

    def check_source(self, source) -> None:
        """Refuse `gguf` for a checkpoint that has no GGUF blocks (model_loader.loader.ModelSource)."""
        if self.method == "gguf" and source.kind != "gguf":
            raise ValueError(f"--quantization gguf keeps a GGUF file's quantized blocks, but {source.path} is a "
                             f"{source.kind} checkpoint; use int8 or int4 (quantized at load) for it")

    def describe(self) -> str:
        if self.method is None:
            return "none"
        if self.method == "gguf":
            return "gguf"
        return f"{self.method} ({'per-channel' if self.group == PER_CHANNEL else f'group {self.group}'})"
