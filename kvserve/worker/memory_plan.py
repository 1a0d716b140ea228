"""KV-pool sizing on CUDA: after the weights are loaded and a warm-up forward at the largest batch, the pool
takes --gpu-memory-utilization of the device's memory minus what is in use (vLLM's rule):

    kv_bytes = utilization x total - in_use - activation_peak

in_use is the device's used memory once the warm-up's caches are released (weights, the CUDA context,
other processes); activation_peak is how far the warm-up's allocations rose above what stays allocated,
which every later step may need again. CUDA graphs are captured after the pool exists, from what is left
(their pool holds a decode batch's activations, far below a prefill's peak).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CudaMemoryPlan:
    total_bytes: int
    utilization: float
    in_use_bytes: int
    activation_peak_bytes: int

    @property
    def budget_bytes(self) -> int:
        return int(self.utilization * self.total_bytes)

    @property
    def kv_cache_bytes(self) -> int:
        return self.budget_bytes - self.in_use_bytes - self.activation_peak_bytes

    def num_blocks(self, bytes_per_block: int) -> int:
        return max(0, self.kv_cache_bytes // bytes_per_block)

    def describe(self) -> str:
        gib = 2 ** 30
        return (f"{self.utilization:g} x {self.total_bytes / gib:.2f} GiB = {self.budget_bytes / gib:.2f} GiB budget "
                f"- {self.in_use_bytes / gib:.2f} GiB in use (weights, CUDA context, other processes) "
                f"- {self.activation_peak_bytes / gib:.2f} GiB activation peak (warm-up at the largest batch) "
                f"= {self.kv_cache_bytes / gib:.2f} GiB for the KV cache")


def plan_cuda_memory(device: torch.device, utilization: float, warm_up: Callable[[], None]) -> CudaMemoryPlan:
    """Run `warm_up` (a forward pass at the largest batch, freeing what it allocates) and measure."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    warm_up()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return CudaMemoryPlan(total, utilization, total - free, peak)
