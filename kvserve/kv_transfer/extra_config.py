"""Checks of a connector's kv_connector_extra_config (its keys are the connector's own)."""
from __future__ import annotations

from kvserve.config.kv_transfer import KVTransferConfig


def check_extra_keys(transfer: KVTransferConfig, known: tuple[str, ...]) -> dict:
    """The extra config, once its keys are known to the connector (a typo is an error at start-up)."""
    extra = transfer.kv_connector_extra_config
    unknown = sorted(set(extra) - set(known))
    if unknown:
        raise ValueError(f"kv_transfer_config: {transfer.kv_connector} does not take kv_connector_extra_config "
                         f"key(s) {', '.join(map(repr, unknown))}; it takes: {', '.join(known) or 'none'}")
    return extra


def positive_int(extra: dict, key: str) -> int | None:
    value = extra.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 1:
        raise ValueError(f"kv_transfer_config: kv_connector_extra_config.{key} must be a positive integer, "
                         f"got {value!r}")
    return int(value)
