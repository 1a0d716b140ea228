"""LoRARequest: which adapter a request runs with (vLLM's shape, so user code ports unchanged)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter folder, named by the user and identified by an integer the engine keys on.

    NOTE: `lora_int_id` (not the name or path) is what slots, the scheduler's max_loras count and the prefix
    cache key on: two requests with the same id must mean the same weights."""

    lora_name: str
    lora_int_id: int
    """>= 1; 0 is reserved for "no adapter" (the base model)."""
    lora_path: str
    """Folder with adapter_config.json and adapter_model.safetensors (or adapter_model.bin)."""

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} has no lora_path")
