"""LoRAManager (worker side): which adapters sit in the model's slots, and a host-memory cache of loaded ones.

    disk --load_adapter--> host LRU (max_cpu_loras adapters) --copy--> slot (max_loras, LRU) --> LoRABatch

The scheduler never puts more than max_loras distinct adapters in one step, so every adapter a step needs
fits at once; a slot goes to a new adapter only when its current one is not in the step (LRU among those).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from kvserve.config.lora import LoRAConfig
from kvserve.layers.lora import LoRABatch, lora_rank_shard
from kvserve.lora.adapter import LoRAAdapter, load_adapter
from kvserve.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, model: nn.Module, batch: LoRABatch, config: LoRAConfig, hf_config, device: torch.device):
        self.batch = batch
        self.config = config
        self.hf_config = hf_config
        self.device = device
        # (decoder layer index, module name, layer) of every layer holding slot tensors (see LoRAMethod)
        self.layers: list[tuple[int, str, nn.Module]] = []
        for name, module in model.named_modules():
            if getattr(module, "lora_a", None) is not None:
                parts = name.split(".")
                self.layers.append((int(parts[parts.index("layers") + 1]), parts[-1], module))
        self.dtype = self.layers[0][2].lora_a.dtype if self.layers else torch.float32
        self._slot_ids: list[int | None] = [None] * config.max_loras      # slot -> adapter id
        self._resident: OrderedDict[int, int] = OrderedDict()              # adapter id -> slot, LRU first
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()          # adapter id -> weights, LRU first
        self.num_slot_loads = 0
        """Adapters copied into a slot so far (tests read it to see swapping happen)."""
        self.num_disk_loads = 0

    @property
    def resident_ids(self) -> set[int]:
        return set(self._resident)

    def set_step(self, token_lora_ids: np.ndarray, requests: dict[int, LoRARequest]) -> None:
        """Make the step's adapters resident, then publish each token's slot to the LoRA layers.
        token_lora_ids [T]: each token's adapter id, 0 for the base model; `requests`: the step's adapters."""
        token_slots = np.full(token_lora_ids.shape, -1, dtype=np.int64)
        for lora_id, slot in self.activate(requests).items():
            token_slots[token_lora_ids == lora_id] = slot
        self.batch.set_token_slots(token_slots, self.device)

    def activate(self, requests: dict[int, LoRARequest]) -> dict[int, int]:
        """Adapter id -> slot for each requested adapter, loading those not resident into the least recently
        used slots whose adapters this step does not need."""
        if len(requests) > self.config.max_loras:
            raise RuntimeError(f"a step needs {len(requests)} adapters but there are {self.config.max_loras} "
                               "slots (the scheduler enforces max_loras)")
        for lora_id in requests:
            if lora_id in self._resident:
                self._resident.move_to_end(lora_id)
        for lora_id, request in requests.items():
            if lora_id in self._resident:
                continue
            slot = self._free_slot(requests)
            self._load_slot(slot, self._adapter(request))
            self._slot_ids[slot] = lora_id
            self._resident[lora_id] = slot
        return {lora_id: self._resident[lora_id] for lora_id in requests}

    def assign(self, slots: dict[int, LoRARequest]) -> None:
        """A follower rank: put the driver's choice of adapter into each slot (loading this rank's shard of
        it where the slot holds another), so the activate of the step that follows finds them resident and
        decides nothing of its own."""
        for slot, request in slots.items():
            lora_id = request.lora_int_id
            if self._resident.get(lora_id) == slot:
                self._resident.move_to_end(lora_id)
                continue
            self._resident.pop(lora_id, None)
            old = self._slot_ids[slot]
            if old is not None:
                self._resident.pop(old, None)
            self._load_slot(slot, self._adapter(request))
            self._slot_ids[slot] = lora_id
            self._resident[lora_id] = slot

    def _free_slot(self, needed: dict[int, LoRARequest]) -> int:
        if None in self._slot_ids:
            return self._slot_ids.index(None)
        victim = next(i for i in self._resident if i not in needed)
        return self._resident.pop(victim)

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._host.get(request.lora_int_id)
        if adapter is not None:
            self._host.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self.hf_config, self.config.max_lora_rank, self.dtype)
        self.num_disk_loads += 1
        self._host[request.lora_int_id] = adapter
        while len(self._host) > self.config.num_cpu_loras:
            self._host.popitem(last=False)
        return adapter

    @torch.inference_mode()
    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write an adapter into `slot` of every LoRA layer: A^T and (scaling * B)^T into slice j's rank
        columns, B into its output columns; everything else in the slot zero (a module it does not adapt)."""
        max_rank, r = self.config.max_lora_rank, adapter.rank
        for layer_idx, name, layer in self.layers:
            layer.lora_a[slot].zero_()
            layer.lora_b[slot].zero_()
            for j, (module, start, size) in enumerate(layer.lora_slices):
                module = module or name  # o_proj and down_proj are not fused: our name is the checkpoint's
                weights = adapter.weights.get((layer_idx, module))
                if weights is None:
                    continue
                a, b = lora_rank_shard(layer, j, *weights)    # this rank's [r, in], [out, r]
                col = j * max_rank
                layer.lora_a[slot, :, col:col + r] = a.t().to(self.device)
                layer.lora_b[slot, col:col + r, start:start + size] = (b * adapter.scaling).t().to(self.device)
        self.num_slot_loads += 1

