"""KV-connector test helpers: --kv-transfer-config objects, a store's files, and an out-of-tree connector that
records the calls it gets (loaded through kv_connector_module_path)."""
from __future__ import annotations

import glob
import os

from kvserve.kv_transfer.base import KVConnectorBase_V1


def storage_config(path: str, role: str = "kv_both", policy: str = "recompute") -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role, "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


def offloading_config(num_cpu_blocks: int, role: str = "kv_both") -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": role,
            "kv_connector_extra_config": {"num_cpu_blocks": num_cpu_blocks}}


def stored_blocks(path: str, tp_size: int = 1) -> list[str]:
    """The block directories of a shared store that are complete (every layer of every rank written)."""
    markers = ["complete"] if tp_size == 1 else [f"complete.rank{r}" for r in range(tp_size)]
    dirs = glob.glob(os.path.join(str(path), "*", "*"))
    return sorted(d for d in dirs if all(os.path.exists(os.path.join(d, m)) for m in markers))


def layer_files(block_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(block_dir, "layer_*.kv")))


def flip_a_byte(path: str) -> None:
    """Corrupt a stored file in its payload (its checksum no longer matches)."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        f.seek(0)
        f.write(data)


class RecordingConnector(KVConnectorBase_V1):
    """An out-of-tree connector that loads nothing and records each call's name, in order."""

    def __init__(self, config, role, kv_spec=None):
        super().__init__(config, role, kv_spec)
        self.calls: list[str] = []
        self.num_layers = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append("get_num_new_matched_tokens")
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append("update_state_after_alloc")

    def build_connector_meta(self, scheduler_output):
        self.calls.append("build_connector_meta")
        return super().build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        self.calls.append("request_finished")
        return False, {"recorded": request.request_id}

    def register_kv_caches(self, kv_caches):
        self.calls.append("register_kv_caches")
        self.num_layers = len(kv_caches)

    def start_load_kv(self, forward_context=None):
        self.calls.append("start_load_kv")

    def wait_for_layer_load(self, layer_index):
        self.calls.append("wait_for_layer_load")

    def save_kv_layer(self, layer_index, kv_layer, attn_metadata=None):
        self.calls.append("save_kv_layer")

    def wait_for_save(self):
        self.calls.append("wait_for_save")

    def get_finished(self, finished_req_ids):
        self.calls.append("get_finished")
        return None, None


class DelayingConnector(KVConnectorBase_V1):
    """A network connector's shape without the network: request_finished delays the free and returns where the
    blocks are; the worker side reports each finished request as sent one step after it hears of it."""

    def __init__(self, config, role, kv_spec=None):
        super().__init__(config, role, kv_spec)
        self._sending: set[str] = set()

    def request_finished(self, request, block_ids):
        return True, {"remote_block_ids": list(block_ids), "remote_engine_id": self.transfer.engine_id,
                      "asked": request.kv_transfer_params}

    def get_finished(self, finished_req_ids):
        done, self._sending = self._sending, set(finished_req_ids)
        return done or None, None
