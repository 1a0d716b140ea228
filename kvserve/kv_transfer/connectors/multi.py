"""MultiConnector: several connectors as one (vLLM's). kv_connector_extra_config.connectors is a list of
kv_transfer_config objects (each with its own kv_connector, kv_connector_extra_config, ...; kv_role defaults
to the outer one). A request loads from the first connector that has any of its tokens; every connector
saves. E.g. a host-memory tier in front of a shared directory."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.config.engine import EngineConfig
from kvserve.config.kv_transfer import KVTransferConfig
from kvserve.core_types import KVConnectorOutput, SchedulerOutput
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvserve.kv_transfer.extra_config import check_extra_keys
from kvserve.request import Request


@dataclass
class MultiKVConnectorMetadata(KVConnectorMetadata):
    metadata: tuple[KVConnectorMetadata, ...] = ()


def child_configs(transfer: KVTransferConfig) -> list[KVTransferConfig]:
    children = check_extra_keys(transfer, ("connectors",)).get("connectors")
    if not isinstance(children, list) or not children:
        raise ValueError("kv_transfer_config: MultiConnector needs kv_connector_extra_config.connectors, a non-empty "
                         "list of kv_transfer_config objects")
    out = []
    for child in children:
        if not isinstance(child, dict):
            raise ValueError(f"kv_transfer_config: each MultiConnector connector is a JSON object, got {child!r}")
        child = {"kv_role": transfer.kv_role, "kv_load_failure_policy": transfer.kv_load_failure_policy, **child}
        out.append(KVTransferConfig.parse(child))
    return out


class MultiConnector(KVConnectorBase_V1):
    composes_connectors = True
    """The factory hands it `make` to build its children."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec | None = None, *,
                 make: Callable[..., KVConnectorBase_V1]):
        """`make(config, role, kv_spec)`: the factory, for the children (each sees its own kv_transfer)."""
        super().__init__(config, role, kv_spec)
        self.connectors = [make(dataclasses.replace(config, kv_transfer=child), role, kv_spec)
                           for child in child_configs(self.transfer)]
        self._chosen: dict[str, int] = {}

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        from kvserve.kv_transfer.factory import KVConnectorFactory  # NOTE: the factory imports this module lazily

        for child in child_configs(config.kv_transfer):
            KVConnectorFactory.check_config(dataclasses.replace(config, kv_transfer=child))

    # ---- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._chosen.pop(request.request_id, None)
        for i, connector in enumerate(self.connectors):
            num, load_async = connector.get_num_new_matched_tokens(request, num_computed_tokens)
            if num is None or num > 0:
                self._chosen[request.request_id] = i
                return num, load_async
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        chosen = self._chosen.pop(request.request_id, None)
        for i, connector in enumerate(self.connectors):
            connector.update_state_after_alloc(request, block_ids, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiKVConnectorMetadata:
        return MultiKVConnectorMetadata(tuple(c.build_connector_meta(scheduler_output) for c in self.connectors))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for connector in self.connectors:
            connector.update_connector_output(connector_output)

    def set_xfer_handshake_metadata(self, metadata: dict | None) -> None:
        for connector, meta in zip(self.connectors, (metadata or {}).get("connectors", [None] * len(self.connectors))):
            connector.set_xfer_handshake_metadata(meta)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._chosen.pop(request.request_id, None)
        delay, params = False, None
        for connector in self.connectors:
            d, p = connector.request_finished(request, block_ids)
            delay = delay or d
            if p:
                params = {**(params or {}), **p}
        return delay, params

    # ---- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list) -> None:
        for connector in self.connectors:
            connector.tp_all_reduce = self.tp_all_reduce
            connector.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> dict | None:
        metas = [c.get_handshake_metadata() for c in self.connectors]
        return {"connectors": metas} if any(m is not None for m in metas) else None

    def bind_connector_metadata(self, metadata: MultiKVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        for connector, meta in zip(self.connectors, metadata.metadata):
            connector.bind_connector_metadata(meta)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for connector in self.connectors:
            connector.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any = None) -> None:
        for connector in self.connectors:
            connector.start_load_kv(forward_context)
        # NOTE: a request whose load failed in one connector saves nothing that step in any of them
        self.skip_saves_of(self.failed_requests())

    def failed_requests(self) -> set[str]:
        return set().union(*(c.failed_requests() for c in self.connectors))

    def skip_saves_of(self, req_ids: set[str]) -> None:
        for connector in self.connectors:
            connector.skip_saves_of(req_ids)

    def wait_for_layer_load(self, layer_index: int) -> None:
        for connector in self.connectors:
            connector.wait_for_layer_load(layer_index)

    def save_kv_layer(self, layer_index: int, kv_layer, attn_metadata: Any = None) -> None:
        for connector in self.connectors:
            connector.save_kv_layer(layer_index, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        for connector in self.connectors:
            connector.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = set(), set()
        for connector in self.connectors:
            s, r = connector.get_finished(finished_req_ids)
            sending |= s or set()
            recving |= r or set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set().union(*(c.get_block_ids_with_load_errors() for c in self.connectors))

    def shutdown(self) -> None:
        for connector in self.connectors:
            connector.shutdown()

    @property
    def num_external_hit_tokens(self) -> int:
        return sum(getattr(c, "num_external_hit_tokens", 0) for c in self.connectors)
