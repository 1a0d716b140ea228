"""KVConnectorFactory: a connector class by vLLM's registered name, or from `kv_connector_module_path`.

Classes are registered as "module:Class" strings and imported when built, so a connector's dependencies load
only when it is asked for. An out-of-tree connector names its module in kv_connector_module_path and its
class in kv_connector; it subclasses KVConnectorBase_V1 and takes (config, role, kv_spec).
"""
from __future__ import annotations

import functools
import importlib

from kvserve.config.engine import EngineConfig
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole

_PKG = "kvserve.kv_transfer.connectors"


class KVConnectorFactory:
    _registry: dict[str, str] = {
        "SharedStorageConnector": f"{_PKG}.shared_storage:SharedStorageConnector",
        "ExampleConnector": f"{_PKG}.shared_storage:SharedStorageConnector",
        "OffloadingConnector": f"{_PKG}.offloading:OffloadingConnector",
        "MultiConnector": f"{_PKG}.multi:MultiConnector",
        "PullConnector": f"{_PKG}.pull:PullConnector",
        "NixlConnector": f"{_PKG}.pull:PullConnector",
    }

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def get_connector_class(cls, config: EngineConfig) -> type[KVConnectorBase_V1]:
        transfer = config.kv_transfer
        name = transfer.kv_connector
        if transfer.kv_connector_module_path:
            try:
                module = importlib.import_module(transfer.kv_connector_module_path)
            except ImportError as e:
                raise ValueError(f"kv_transfer_config: cannot import kv_connector_module_path "
                                 f"{transfer.kv_connector_module_path!r}: {e}") from None
            target = getattr(module, name, None)
            if target is None:
                raise ValueError(f"kv_transfer_config: {transfer.kv_connector_module_path} has no class {name!r}")
        elif name in cls._registry:
            module_name, class_name = cls._registry[name].split(":")
            target = getattr(importlib.import_module(module_name), class_name)
        else:
            raise ValueError(f"kv_transfer_config: unknown kv_connector {name!r}; known: {', '.join(cls.names())} "
                             "(or give kv_connector_module_path for an out-of-tree connector)")
        if not (isinstance(target, type) and issubclass(target, KVConnectorBase_V1)):
            raise ValueError(f"kv_transfer_config: {name} is not a KVConnectorBase_V1 subclass")
        return target

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        """The connector exists and takes its extra config: checked before the model loads."""
        cls.get_connector_class(config).check_config(config)

    @classmethod
    def create_connector(cls, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec | None = None, *,
                         tp_rank: int = 0) -> KVConnectorBase_V1:
        target = cls.get_connector_class(config)
        if getattr(target, "composes_connectors", False):
            connector = target(config, role, kv_spec, make=functools.partial(cls.create_connector, tp_rank=tp_rank))
        else:
            connector = target(config, role, kv_spec)
        connector.tp_rank = tp_rank
        return connector


def check_supported(config: EngineConfig) -> None:
    """What the local connectors do not combine with yet, refused by name at start-up."""
    if config.draft_model is not None:
        raise ValueError("--kv-transfer-config with a draft model is not supported yet (the draft's KV of a loaded "
                         "prefix is not stored); use ngram speculation")
    if config.kv_release_window is not None:
        raise ValueError("--kv-transfer-config with a model whose every layer is windowed is not supported yet "
                         "(its tables release blocks while a request runs)")
