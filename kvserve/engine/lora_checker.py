"""AdapterChecker (front end): a LoRARequest is checked once, at admission, before it reaches the core.

A bad adapter (missing files, rank over max_lora_rank, modules or shapes of another model) is then the
caller's ValueError, not a failed engine step. An id is bound to the first path it was admitted with: the
worker's slots and the prefix cache key on the id, so one id naming two adapters would mix their KV.
"""
from __future__ import annotations

from kvserve.config.lora import LoRAConfig
from kvserve.lora.adapter import load_adapter
from kvserve.lora.request import LoRARequest


class AdapterChecker:
    def __init__(self, hf_config, config: LoRAConfig | None):
        self.hf_config = hf_config
        self.config = config
        self._paths: dict[int, str] = {}  # adapter id -> the path it was checked with

    def check(self, request: LoRARequest) -> None:
        """Raises ValueError if the engine cannot run this adapter (TypeError if it is no LoRARequest)."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if self.config is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r} requested, but LoRA is off (enable_lora=True)")
        known = self._paths.get(request.lora_int_id)
        if known is not None:
            if known != request.lora_path:
                raise ValueError(f"lora_int_id {request.lora_int_id} is already the adapter at {known}, "
                                 f"not {request.lora_path}: each adapter needs its own id")
            return
        load_adapter(request, self.hf_config, self.config.max_lora_rank)
        self._paths[request.lora_int_id] = request.lora_path
