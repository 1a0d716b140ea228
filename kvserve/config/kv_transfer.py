"""KVTransferConfig: vLLM's `--kv-transfer-config` JSON, validated at start-up.

The keys are vLLM's, so a config written for vLLM starts kvserve unchanged; an unknown key or a bad value is
an error naming it (a typo must not silently turn the connector off). Which connector names exist is the
connector factory's business (kv_transfer/factory.py), checked when the engine builds it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.config.json_flag import json_object_fields

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str | None = None
    """The connector's registered name (SharedStorageConnector, OffloadingConnector, MultiConnector, ...)."""
    kv_role: str | None = None
    """kv_producer (saves KV), kv_consumer (loads KV) or kv_both."""
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: str | None = None
    kv_buffer_device: str = "cpu"
    kv_buffer_size: float = 1e9
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """The connector's own settings (shared_storage_path, num_cpu_blocks, connectors, ...)."""
    kv_connector_module_path: str | None = None
    """A module to import the connector class `kv_connector` from (an out-of-tree connector)."""
    kv_load_failure_policy: str = "recompute"
    """What a failed load (missing or corrupt KV) does: recompute those tokens, or fail the request."""

    def __post_init__(self) -> None:
        if self.kv_connector is not None and not isinstance(self.kv_connector, str):
            raise ValueError(f"kv_transfer_config: kv_connector must be a string, got {self.kv_connector!r}")
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError("kv_transfer_config: kv_role (kv_producer, kv_consumer or kv_both) is required when "
                             "kv_connector is set")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config: kv_load_failure_policy must be one of "
                             f"{', '.join(KV_LOAD_FAILURE_POLICIES)}, got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be a JSON object, got "
                             f"{self.kv_connector_extra_config!r}")
        for name, least in (("kv_parallel_size", 1), ("kv_port", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"kv_transfer_config: {name} must be an integer >= {least}, got {value!r}")
        if self.kv_rank is not None and (not isinstance(self.kv_rank, int) or self.kv_rank < 0):
            raise ValueError(f"kv_transfer_config: kv_rank must be a non-negative integer, got {self.kv_rank!r}")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: str | dict | KVTransferConfig | None) -> KVTransferConfig | None:
        """From the flag's JSON text, a dict (the Python API) or a config; None, "" and "none" are no connector."""
        if isinstance(value, cls):
            return value
        value = json_object_fields(value, cls, "kv_transfer_config")
        return None if value is None else cls(**value)
