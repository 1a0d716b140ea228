"""CacheConfig: the paged KV cache (block size, its element type, how much memory it gets, prefix caching and
pins)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv_cache.quant import KV_CACHE_DTYPES
from kvserve.kv_cache.reservation import KV_RESERVATIONS


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int
    """Tokens per KV block (a power of two)."""
    kv_cache_memory_bytes: int
    """Pool size on CPU."""
    gpu_memory_utilization: float
    """Fraction of GPU memory for weights + activations + KV (CUDA only)."""
    num_gpu_blocks_override: int | None
    """Exactly this many blocks, whatever the memory (tests, experiments)."""
    enable_prefix_caching: bool
    """Reuse the KV blocks of prompt prefixes already computed."""
    max_pinned_fraction: float
    """Most of the pool that prompt-cache pins may hold."""
    kv_cache_dtype: str = "auto"
    """auto (the model's dtype), int8 or fp8_e4m3: K/V in one byte per element with per-token, per-head
    scales (kv_cache/quant.py)."""
    kv_reservation: str = "paged"
    """paged, or contiguous: max_model_len tokens of blocks set aside per request (kv_cache/reservation.py)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_reservation not in KV_RESERVATIONS:
            raise ValueError(f"kv_reservation must be one of {', '.join(KV_RESERVATIONS)}, "
                             f"got {self.kv_reservation!r}")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}")
