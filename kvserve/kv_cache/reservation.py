"""Contiguous reservation (`--kv-reservation contiguous`): the KV allocation engines used before PagedAttention.

Each admitted request has max_model_len tokens of blocks set aside for it (what FasterTransformer and Orca
reserved: a contiguous slab per sequence, sized for the longest sequence the model allows). The blocks are
still handed out one by one as the request grows (the kernels are the same), but admission counts the whole
slab: a request is admitted only when its slab fits beside every running request's, so it never preempts and
far fewer requests run at once. The outputs are the same as with paged allocation.
"""
from __future__ import annotations

from collections.abc import Mapping, Sized

KV_RESERVATIONS = ("paged", "contiguous")


class Reservations:
    def __init__(self, reserve_blocks: int | None):
        """`reserve_blocks`: the slab of each request, in blocks; None: paged allocation (nothing set aside)."""
        self.reserve_blocks = reserve_blocks
        self._admitted: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.reserve_blocks is not None

    def set_aside(self, tables: Mapping[str, Sized], exclude: str | None = None) -> int:
        """Free blocks promised to admitted requests (their slabs less the blocks they already hold)."""
        if self.reserve_blocks is None:
            return 0
        return sum(max(0, self.reserve_blocks - len(tables.get(rid, ()))) for rid in self._admitted if rid != exclude)

    def blocks_to_find(self, request_id: str, num_new_blocks: int, num_held: int) -> int:
        """Free blocks an allocation of num_new_blocks needs beyond the others' slabs: a request not yet admitted
        needs its whole slab (less the num_held it takes from the prefix cache)."""
        if self.reserve_blocks is None or request_id in self._admitted:
            return num_new_blocks
        return max(num_new_blocks, self.reserve_blocks - num_held)

    def admit(self, request_id: str) -> None:
        if self.reserve_blocks is not None:
            self._admitted.add(request_id)

    def release(self, request_id: str) -> None:
        self._admitted.discard(request_id)

    def is_admitted(self, request_id: str) -> bool:
        return request_id in self._admitted


def reserve_blocks(cache, max_model_len: int, num_blocks: int) -> int | None:
    """The slab of each request under `cache.kv_reservation` (a CacheConfig), or None when paged. Raises when
    one slab does not fit the pool (no request could ever be admitted)."""
    if cache.kv_reservation == "paged":
        return None
    slab = -(-max_model_len // cache.block_size)
    if slab > num_blocks:
        raise ValueError(f"--kv-reservation contiguous sets aside max_model_len ({max_model_len} tokens = {slab} "
                         f"blocks) per request, but the KV pool holds {num_blocks} blocks: lower --max-model-len "
                         f"or raise --kv-cache-memory")
    return slab
