"""OffloadingConnector: a bounded host-memory tier under the device's KV pool.

kv_connector_extra_config: {"num_cpu_blocks": N} or {"cpu_bytes_to_use": BYTES} (vLLM's keys; "block_size",
if given, must be the cache's). Every full prompt block a step computes is copied to a host slot as it is
computed (vLLM's offloading connector stores on compute too), so a block the device pool later evicts is
still there; a later request whose prefix the device pool lost loads it back. The host tier forgets its
least recently used block when full. The scheduler side owns the index (digest -> slot); the worker side
owns the host tensors and tags each slot with the digest it holds, so a slot that was not (re)written is a
load error, never stale KV.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch

from kvserve.config.engine import EngineConfig
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorRole
from kvserve.kv_transfer.block_store import BlockTransfer, PrefixStoreConnector, layer_parts
from kvserve.kv_transfer.extra_config import check_extra_keys, positive_int

_KEYS = ("num_cpu_blocks", "cpu_bytes_to_use", "block_size", "spec_name")


def num_host_blocks(config: EngineConfig, kv_spec: KVCacheSpec | None) -> int | None:
    """The host tier's blocks (None without a spec: the keys and values are checked alone)."""
    extra = check_extra_keys(config.kv_transfer, _KEYS)
    block_size = positive_int(extra, "block_size")
    if block_size is not None and block_size != config.cache.block_size:
        raise ValueError(f"kv_transfer_config: OffloadingConnector block_size {block_size} must equal the KV "
                         f"cache's --block-size {config.cache.block_size}")
    num = positive_int(extra, "num_cpu_blocks")
    num_bytes = positive_int(extra, "cpu_bytes_to_use")
    if num is None and num_bytes is None:
        raise ValueError("kv_transfer_config: OffloadingConnector needs kv_connector_extra_config.num_cpu_blocks "
                         "or cpu_bytes_to_use")
    if num is None and kv_spec is not None:
        num = num_bytes // kv_spec.bytes_per_block
        if not num:
            raise ValueError(f"kv_transfer_config: cpu_bytes_to_use {num_bytes} holds no KV block "
                             f"({kv_spec.bytes_per_block} bytes)")
    return num


class OffloadingConnector(PrefixStoreConnector):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec | None = None):
        super().__init__(config, role, kv_spec)
        if kv_spec is None:
            raise ValueError("OffloadingConnector sizes its host tier from the KV cache spec")
        self.num_host_blocks = num_host_blocks(config, kv_spec)
        self._index: OrderedDict[str, int] = OrderedDict()  # digest -> host slot, least recently used first
        self._free_slots = list(range(self.num_host_blocks - 1, -1, -1))
        self.host_layers: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._tags: list[str | None] = []

    # ---- scheduler side: the index ------------------------------------------------------------------
    def _has(self, digest: str) -> bool:
        return digest in self._index

    def _load_key(self, digest: str) -> Hashable:
        self._index.move_to_end(digest)
        return self._index[digest], digest

    def _save_key(self, digest: str) -> Hashable | None:
        if digest in self._index:
            self._index.move_to_end(digest)
            return None
        slot = self._free_slots.pop() if self._free_slots else self._index.popitem(last=False)[1]
        self._index[digest] = slot
        return slot, digest

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        num_host_blocks(config, None)

    @property
    def num_host_blocks_used(self) -> int:
        return len(self._index)

    # ---- worker side: the host tensors --------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list) -> None:
        super().register_kv_caches(kv_caches)
        n = self.num_host_blocks
        self._tags = [None] * n
        self.host_layers = []
        for kv_layer in kv_caches:
            parts = []
            for part in layer_parts(kv_layer):
                parts.append(None if part is None else torch.empty(
                    (n, *part.shape[1:]), dtype=part.dtype, device="cpu", pin_memory=part.is_cuda))
            self.host_layers.append(tuple(parts))

    def _read_block(self, transfer: BlockTransfer) -> None:
        slot, digest = transfer.key
        if self._tags[slot] != digest:
            raise ValueError(f"host slot {slot} does not hold the block asked for (it was not written)")
        for kv_layer, host in zip(self.kv_caches, self.host_layers):
            for dest, src in zip(layer_parts(kv_layer), host):
                if dest is not None:
                    dest[transfer.block_id].copy_(src[slot], non_blocking=False)

    def _write_block(self, layer_index: int, kv_layer, transfer: BlockTransfer) -> None:
        slot, _ = transfer.key
        if layer_index == 0:
            self._tags[slot] = None  # invalid until every layer is written (_commit_saves)
        for src, dest in zip(layer_parts(kv_layer), self.host_layers[layer_index]):
            if src is not None:
                dest[slot].copy_(src[transfer.block_id])

    def _commit_saves(self, saves: list[BlockTransfer]) -> None:
        for transfer in saves:
            slot, digest = transfer.key
            self._tags[slot] = digest
