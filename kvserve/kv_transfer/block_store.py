"""PrefixStoreConnector: what every local block store shares (a directory, host memory): both roles' bookkeeping.

Scheduler side: a prompt's full blocks are named by their chained digests (block_keys.py); the tokens past
the local prefix-cache hit whose blocks the store holds are an external hit, loaded into the blocks the
scheduler allocated for them; each full prompt block a step computes is saved. Worker side: the subclass
moves one block of one layer (`_read_block` / `_write_block`); this class drives the loads, the saves and
the load errors. A request whose load failed saves nothing that step (its later blocks were computed from
invalid KV).
"""
from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from kvserve.config.engine import EngineConfig
from kvserve.core_types import SchedulerOutput
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvserve.kv_transfer.block_keys import BlockDigests, store_namespace
from kvserve.request import Request

logger = logging.getLogger("kvserve")


@dataclass(frozen=True)
class BlockTransfer:
    req_id: str
    block_id: int
    """The block in the worker's KV cache."""
    key: Hashable
    """Where it lives in the store (a digest, a host slot)."""


@dataclass
class BlockStoreMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


def layer_parts(kv_layer) -> tuple[Any, Any]:
    """(values, scales or None) of one layer's cache; both are indexed by block first."""
    scales = getattr(kv_layer, "scales", None)
    return (kv_layer.values, scales) if scales is not None else (kv_layer, None)


class BlockTableMirror:
    """The block tables as the worker knows them, rebuilt from each step's diff (the scheduler side saves
    blocks by id without reaching into the KV cache manager)."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        """Request -> its computed tokens before this step (for the requests scheduled in it)."""

    def apply(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(req_id, None)
        self.computed = {}
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for req_id, resumed, ids, computed in zip(cached.req_ids, cached.resumed_from_preemption,
                                                  cached.new_block_ids, cached.num_computed_tokens):
            table = self.tables.setdefault(req_id, [])
            if resumed:
                table.clear()
            kept = cached.num_kept_blocks.get(req_id)
            if kept is not None:
                del table[kept:]
            table.extend(ids)
            self.computed[req_id] = computed

    def forget(self, req_id: str) -> None:
        self.tables.pop(req_id, None)


class PrefixStoreConnector(KVConnectorBase_V1):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec | None = None):
        super().__init__(config, role, kv_spec)
        self.block_size = config.cache.block_size
        self.digests = BlockDigests(store_namespace(config), self.block_size)
        self._requests: dict[str, Request] = {}
        self._load_from: dict[str, int] = {}  # request -> first block of its external hit
        self._mirror = BlockTableMirror()
        self._loads: list[BlockTransfer] = []
        self.num_external_hit_tokens = 0
        """Prompt tokens loaded from the store (scheduler side), over the connector's life."""
        self.num_saved_blocks = 0
        """Blocks handed to the worker to save (scheduler side)."""
        self.kv_caches: list = []
        self._errors: set[int] = set()
        self._failed: set[str] = set()
        self._skip_saves: set[str] = set()

    # ---- what a store implements ------------------------------------------------------------------
    def _has(self, digest: str) -> bool:
        raise NotImplementedError

    def _load_key(self, digest: str) -> Hashable:
        return digest

    def _save_key(self, digest: str) -> Hashable | None:
        """Where to save the block named `digest`; None: the store holds it already."""
        return None if self._has(digest) else digest

    def _read_block(self, transfer: BlockTransfer) -> None:
        """Worker side: copy the stored block into every layer's cache; raise ValueError when it is invalid."""
        raise NotImplementedError

    def _write_block(self, layer_index: int, kv_layer, transfer: BlockTransfer) -> None:
        raise NotImplementedError

    def _commit_saves(self, saves: list[BlockTransfer]) -> None:
        """Worker side: every layer of `saves` is written; make them visible."""

    # ---- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.transfer.is_kv_consumer or request.skip_reading_prefix_cache:
            return 0, False
        first = num_computed_tokens // self.block_size
        num = 0
        for digest in self.digests.of(request, (request.num_tokens - 1) // self.block_size)[first:]:
            if not self._has(digest):
                break
            num += 1
        self._load_from[request.request_id] = first
        return num * self.block_size, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        first = self._load_from.pop(request.request_id, 0)
        num = num_external_tokens // self.block_size
        if not num:
            return
        digests = self.digests.of(request, first + num)
        self._loads += [BlockTransfer(request.request_id, block_ids[i], self._load_key(digests[i]))
                        for i in range(first, first + num)]
        self.num_external_hit_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BlockStoreMetadata:
        self._mirror.apply(scheduler_output)
        saves = []
        if self.transfer.is_kv_producer:
            bs = self.block_size
            for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
                req = self._requests.get(req_id)
                if req is None:
                    continue
                computed = self._mirror.computed[req_id]
                end = min(computed + num_new, req.num_prompt_tokens) // bs  # full prompt blocks after the step
                table = self._mirror.tables[req_id]
                for i, digest in enumerate(self.digests.of(req, end)[computed // bs:], start=computed // bs):
                    key = self._save_key(digest)
                    if key is not None:
                        saves.append(BlockTransfer(req_id, table[i], key))
        self.num_saved_blocks += len(saves)
        meta, self._loads = BlockStoreMetadata(self._loads, saves), []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._load_from.pop(req_id, None)
        self._mirror.forget(req_id)
        self.digests.forget(req_id)
        return False, None

    # ---- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self, forward_context: Any = None) -> None:
        self._errors, self._failed, self._skip_saves = set(), set(), set()
        for transfer in self._metadata.loads:
            try:
                self._read_block(transfer)
            except ValueError as e:
                logger.warning("KV connector: the load of block %d for request %s failed: %s", transfer.block_id,
                               transfer.req_id, e)
                self._errors.add(transfer.block_id)
                self._failed.add(transfer.req_id)
                self._skip_saves.add(transfer.req_id)

    def skip_saves_of(self, req_ids: set[str]) -> None:
        """These requests' loads failed (here or in a sibling connector): their blocks this step are invalid."""
        self._skip_saves |= req_ids

    def failed_requests(self) -> set[str]:
        return set(self._failed)

    def _saves(self) -> list[BlockTransfer]:
        return [t for t in self._metadata.saves if t.req_id not in self._skip_saves]

    def save_kv_layer(self, layer_index: int, kv_layer, attn_metadata: Any = None) -> None:
        for transfer in self._saves():
            self._write_block(layer_index, kv_layer, transfer)

    def wait_for_save(self) -> None:
        self._commit_saves(self._saves())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._errors)
