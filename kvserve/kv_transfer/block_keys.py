"""Stable names for block-aligned prefixes: the prefix cache's chained block keys, as digests.

The prefix cache keys a full block by (its parent's key, its tokens, the request's extra key: cache salt and
adapter); Python's hash() of such a key changes from process to process, so a store that outlives the
process names the same chain with sha256. A namespace (the model, its KV dtype and block size) starts every
chain, so two models sharing a store never alias.
"""
from __future__ import annotations

import hashlib

import numpy as np

from kvserve.config.engine import EngineConfig
from kvserve.request import Request


def store_namespace(config: EngineConfig) -> str:
    """What must match for a stored block to be valid here: the model (its files and config), the dtypes, the
    block size and the tensor-parallel size (each rank stores its heads; the layout is checked again, tensor by
    tensor, at load)."""
    mc = config.model
    hf = mc.hf_config.to_json_string() if hasattr(mc.hf_config, "to_json_string") else repr(mc.hf_config)
    ident = repr((mc.source.kind, mc.source.path, hf, str(mc.dtype), config.cache.kv_cache_dtype,
                  config.cache.block_size, config.parallel.tensor_parallel_size))
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def _request_extra(request: Request) -> str:
    """The request's extra key, by value (an adapter's int id is per process; its name and path are not)."""
    lora = request.lora_request
    return repr((request.cache_salt, None if lora is None else (lora.lora_name, lora.lora_path)))


class BlockDigests:
    """A request's chained block digests, computed once per block and extended as it grows."""

    def __init__(self, namespace: str, block_size: int):
        self.namespace = namespace
        self.block_size = block_size
        self._digests: dict[str, list[str]] = {}

    def of(self, request: Request, num_blocks: int) -> list[str]:
        digests = self._digests.setdefault(request.request_id, [])
        extra = _request_extra(request).encode()
        bs = self.block_size
        while len(digests) < num_blocks:
            i = len(digests)
            h = hashlib.sha256((digests[-1] if digests else self.namespace).encode())
            h.update(np.asarray(request.token_slice(i * bs, (i + 1) * bs), dtype=np.int64).tobytes())
            h.update(extra)
            digests.append(h.hexdigest())
        return digests[:num_blocks]

    def forget(self, request_id: str) -> None:
        self._digests.pop(request_id, None)
