"""SharedStorageConnector (vLLM's newer name: ExampleConnector): a prefix cache in a directory.

kv_connector_extra_config: {"shared_storage_path": DIR} (default /tmp/kvserve_kv). Layout:
DIR/<namespace>/<block digest>/layer_<i>.kv, one file per layer per block-aligned prefix, and a `complete`
marker written after the last layer, so a reader never takes a half-written block (with tensor parallelism
each rank writes its own heads: layer_<i>.rank<r>.kv and complete.rank<r>; a block is there when every
rank's part is). Each file is the sha256 of
its payload, then the payload (the block's values and, for an int8/fp8 cache, its scales, as torch.save
writes them); files are written under a temporary name and renamed, so engines may share the directory. A
missing file, a bad checksum or a tensor of another shape or dtype is a load error (kv_load_failure_policy).
"""
from __future__ import annotations

import hashlib
import io
import os
import tempfile

import torch

from kvserve.config.engine import EngineConfig
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorRole
from kvserve.kv_transfer.block_keys import store_namespace
from kvserve.kv_transfer.block_store import BlockTransfer, PrefixStoreConnector, layer_parts
from kvserve.kv_transfer.extra_config import check_extra_keys

DEFAULT_PATH = "/tmp/kvserve_kv"
_COMPLETE = "complete"
_DIGEST_BYTES = 32
_KEYS = ("shared_storage_path",)


class SharedStorageConnector(PrefixStoreConnector):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec | None = None):
        super().__init__(config, role, kv_spec)
        extra = check_extra_keys(self.transfer, _KEYS)
        self.root = os.path.join(str(extra.get("shared_storage_path", DEFAULT_PATH)), store_namespace(config))
        os.makedirs(self.root, exist_ok=True)

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        check_extra_keys(config.kv_transfer, _KEYS)

    def _dir(self, digest: str) -> str:
        return os.path.join(self.root, digest)

    def _marker(self, digest: str, rank: int) -> str:
        """Written after a rank's last layer file of the block (with tensor parallelism, each rank its own)."""
        return os.path.join(self._dir(digest), _COMPLETE if self.tp_size == 1 else f"{_COMPLETE}.rank{rank}")

    def _layer_file(self, digest: str, layer_index: int) -> str:
        suffix = "" if self.tp_size == 1 else f".rank{self.tp_rank}"
        return os.path.join(self._dir(digest), f"layer_{layer_index}{suffix}.kv")

    def _has(self, digest: str) -> bool:
        """Scheduler side: every rank's part of the block is stored."""
        return all(os.path.exists(self._marker(digest, r)) for r in range(self.tp_size))

    # ---- worker side -------------------------------------------------------------------------------
    def _read_block(self, transfer: BlockTransfer) -> None:
        try:
            self._read_layers(transfer)
        except ValueError:
            # NOTE: no longer complete, so the recompute (policy recompute) saves the block again
            try:
                os.unlink(self._marker(transfer.key, self.tp_rank))
            except OSError:
                pass
            raise

    def _read_layers(self, transfer: BlockTransfer) -> None:
        for i, kv_layer in enumerate(self.kv_caches):
            path = self._layer_file(transfer.key, i)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise ValueError(f"cannot read {path}: {e.strerror}") from None
            payload = data[_DIGEST_BYTES:]
            if len(data) < _DIGEST_BYTES or hashlib.sha256(payload).digest() != data[:_DIGEST_BYTES]:
                raise ValueError(f"{path}: checksum mismatch (corrupt or truncated)")
            stored = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
            for dest, name in zip(layer_parts(kv_layer), ("values", "scales")):
                src = stored.get(name)
                if dest is None:
                    continue
                if src is None or src.shape != dest[transfer.block_id].shape or src.dtype != dest.dtype:
                    raise ValueError(f"{path}: {name} do not match this cache's block layout")
                dest[transfer.block_id].copy_(src)

    def _write_block(self, layer_index: int, kv_layer, transfer: BlockTransfer) -> None:
        if os.path.exists(self._marker(transfer.key, self.tp_rank)):
            return  # another engine saved the same prefix meanwhile
        values, scales = layer_parts(kv_layer)
        block = {"values": values[transfer.block_id].to("cpu", copy=True)}
        if scales is not None:
            block["scales"] = scales[transfer.block_id].to("cpu", copy=True)
        buf = io.BytesIO()
        torch.save(block, buf)
        payload = buf.getvalue()
        directory = self._dir(transfer.key)
        os.makedirs(directory, exist_ok=True)
        _write_atomic(self._layer_file(transfer.key, layer_index), hashlib.sha256(payload).digest() + payload)

    def _commit_saves(self, saves: list[BlockTransfer]) -> None:
        for digest in {t.key for t in saves}:
            marker = self._marker(digest, self.tp_rank)
            if not os.path.exists(marker):
                _write_atomic(marker, b"")


def _write_atomic(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
