"""The KV-connector seam, vLLM's KVConnectorBase_V1 shape: one connector class, one instance per role.

The scheduler-side instance decides (which prompt tokens an external store holds, which blocks to load
and save this step) and owns no tensor; the worker-side instance moves KV between the store and the
worker's KV cache and decides nothing. What crosses between them is one KVConnectorMetadata per step
(SchedulerOutput.kv_connector_metadata) one way and one KVConnectorOutput (ModelRunnerOutput) back.

Order of the calls, each step:
  scheduler: get_num_new_matched_tokens -> (blocks allocated) -> update_state_after_alloc for each admitted
             request; build_connector_meta(scheduler_output) once; request_finished when a request ends.
  worker:    bind_connector_metadata -> start_load_kv -> wait_for_layer_load (each layer) -> the forward pass
             -> save_kv_layer (each layer) -> wait_for_save -> get_finished / get_block_ids_with_load_errors
             -> clear_connector_metadata.
NOTE: kvserve calls the per-layer hooks around the forward pass, not from inside each attention layer: the
local stores' loads are synchronous and the saves read the finished cache, so a connector sees the same calls in
the same order, only not interleaved with the layers. An asynchronous load (load_async, the pull connector) parks
its request (WAITING_FOR_REMOTE_KVS) holding its blocks until the worker reports it in finished_recving.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from kvserve.config.engine import EngineConfig
from kvserve.core_types import KVConnectorOutput, SchedulerOutput
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.request import Request


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


@dataclass
class KVConnectorMetadata:
    """What one step's scheduler-side connector tells its worker side (each connector subclasses it)."""


class KVConnectorBase_V1:
    """Both roles' calls; a connector implements those of the roles it serves. The defaults do nothing, so an
    instance of a role never sees the other role's calls."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec | None = None):
        """`kv_spec`: the KV cache (worker side: this rank's)."""
        self.config = config
        self.transfer = config.kv_transfer
        self.role = role
        self.kv_spec = kv_spec
        self.tp_rank = 0
        """The worker side's tensor-parallel rank, whose KV heads it moves (every rank has a worker-side
        connector); set by the factory once the connector is built."""
        self.tp_size = config.parallel.tensor_parallel_size
        self.tp_all_reduce = None
        """kvserve's own: with tensor parallelism, the sum over ranks of a tensor (every rank calls it at the same
        point), set on the worker side before register_kv_caches; None: one rank."""
        self._metadata: KVConnectorMetadata | None = None

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        """kvserve's own: refuse a bad kv_connector_extra_config before the model loads (ValueError)."""

    # ---- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past `num_computed_tokens` (the local prefix-cache hit, block aligned) that the connector can
        load, and whether it loads them asynchronously. None: not known yet (ask again in a later step)."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request was admitted with `num_external_tokens` to load; `block_ids` is its whole table now."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's instructions for the worker side; resets what was handed over."""
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """What the worker side reported this step (finished sends and loads), before the scheduler acts on it."""

    def set_xfer_handshake_metadata(self, metadata: dict | None) -> None:
        """The worker side's get_handshake_metadata (where its side channel listens), once the engine started."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request finished (or was aborted). Returns (delay_free: the connector still reads its blocks and
        will report it in finished_sending, kv_transfer_params for the response)."""
        return False, None

    # ---- worker side --------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list) -> None:
        """The worker's per-layer caches (a tensor, or a QuantizedKVCache of values and scales), block first."""

    def get_handshake_metadata(self) -> dict | None:
        """What the scheduler side must know of this worker side (a side channel's address); None: nothing."""
        return None

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Begin (here: do) this step's loads, before the forward pass."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Block until layer `layer_index`'s loads are in the cache."""

    def save_kv_layer(self, layer_index: int, kv_layer, attn_metadata: Any = None) -> None:
        """Save this step's blocks of one layer (after the forward pass wrote them)."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are durable."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose sends completed, requests whose asynchronous loads completed) since the last call."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of this step's loads that failed (missing or corrupt): their KV is not valid."""
        return set()

    # kvserve's own (not vLLM's): the blocks a request computes in a step whose load failed are computed from
    # invalid KV, wherever the load failed (another connector of a MultiConnector, another tensor-parallel rank)
    def failed_requests(self) -> set[str]:
        """Requests whose load failed in this connector this step."""
        return set()

    def skip_saves_of(self, req_ids: set[str]) -> None:
        """Save nothing of these requests this step."""

    def shutdown(self) -> None:
        pass
