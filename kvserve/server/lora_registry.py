"""The server's LoRA adapters by name: those of --lora-modules, and those loaded or unloaded at run time
(POST /v1/load_lora_adapter, /v1/unload_lora_adapter). A request's `model` field names one.

Unloading takes the name away at once (new requests for it get 404); requests already running finish with
the adapter they started with, whose slot the engine reuses when another adapter needs it. Ids are never
reused, so an adapter loaded again under the same name never shares prefix-cache blocks with the old one.
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Awaitable, Callable

from kvserve.lora.request import LoRARequest
from kvserve.server.errors import APIError


class LoRARegistry:
    def __init__(self, enabled: bool, allowed_dirs: tuple[str, ...] | None):
        self.enabled = enabled
        self.allowed_dirs = tuple(os.path.realpath(d) for d in allowed_dirs) if allowed_dirs else None
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str | None) -> LoRARequest | None:
        return self._adapters.get(name) if name else None

    @property
    def names(self) -> list[str]:
        return list(self._adapters)

    def adapters(self) -> list[LoRARequest]:
        return list(self._adapters.values())

    async def load(self, name: str, path: str, base_names: list[str],
                   check: Callable[[LoRARequest], Awaitable[None]]) -> LoRARequest:
        """Register an adapter after `check` (which loads it) passes. Raises APIError (400) naming the problem."""
        if not self.enabled:
            raise APIError(400, "LoRA adapters are off: start the server with --enable-lora", param="lora_name")
        if not name or not path:
            raise APIError(400, "lora_name and lora_path are both required", param="lora_name")
        if name in self._adapters or name in base_names:
            raise APIError(400, f"the name {name!r} is already in use", param="lora_name")
        real = os.path.realpath(path)
        if self.allowed_dirs is not None and not any(_within(real, d) for d in self.allowed_dirs):
            raise APIError(400, f"lora_path {path!r} is outside --allowed-lora-dirs", param="lora_path")
        request = LoRARequest(name, next(self._ids), real)
        try:
            await check(request)
        except (ValueError, TypeError, OSError) as e:
            raise APIError(400, f"LoRA adapter {name!r} cannot be loaded: {e}", param="lora_path") from None
        self._adapters[name] = request
        return request

    def unload(self, name: str) -> LoRARequest:
        if not self.enabled:
            raise APIError(400, "LoRA adapters are off: start the server with --enable-lora", param="lora_name")
        request = self._adapters.pop(name, None)
        if request is None:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                           code="model_not_found")
        return request


def _within(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def parse_lora_modules(specs: tuple[str, ...] | None) -> list[tuple[str, str]]:
    """--lora-modules name=path ... -> [(name, path)]."""
    out = []
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {spec!r}")
        out.append((name, path))
    return out
