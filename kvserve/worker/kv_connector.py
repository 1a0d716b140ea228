"""The worker-side KV connector's calls around one step of the model runner (kv_transfer/base.py has the order).

Loads run after the step's diff is applied and before the forward pass; saves after it. A request one of whose
blocks failed to load gets no sampled token this step (its logits came from invalid KV): the scheduler then
recomputes from the first bad block or fails the request (kv_load_failure_policy). With tensor parallelism
each rank loads its own heads; the ranks agree on the failed blocks (a sum over ranks) before anyone samples
or saves, since one rank's bad heads spoil every rank's output.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.core_types import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from kvserve.kv_cache.quant import QuantizedKVCache
from kvserve.worker.input_batch import InputBatch


@dataclass
class ConnectorStep:
    connector: object
    """The worker-side KVConnectorBase_V1."""
    kv_caches: list
    num_blocks: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Tensor parallelism: the sum over ranks; None: one rank."""
    invalid: set[int] = field(default_factory=set)
    """This step's blocks whose load failed (on any rank)."""

    def begin(self, out: SchedulerOutput, batch: InputBatch) -> set[str]:
        """Bind the step's metadata and load; returns the scheduled requests owning a block whose load failed."""
        self.invalid = set()
        meta = out.kv_connector_metadata
        if meta is None:
            return set()
        connector = self.connector
        connector.bind_connector_metadata(meta)
        connector.start_load_kv()
        for i in range(len(self.kv_caches)):
            connector.wait_for_layer_load(i)
        self.invalid = self._agree(connector.get_block_ids_with_load_errors())
        if not self.invalid:
            return set()
        failed = set()
        for req_id in out.num_scheduled_tokens:
            row = batch.index[req_id]
            if self.invalid.intersection(batch.block_table[row, :batch.num_blocks[row]].tolist()):
                failed.add(req_id)
        connector.skip_saves_of(failed)  # another rank's failure spoils this rank's blocks too
        return failed

    def _agree(self, invalid: set[int]) -> set[int]:
        if self.all_reduce is None:
            return set(invalid)
        first = self.kv_caches[0]
        device = (first.values if isinstance(first, QuantizedKVCache) else first).device
        mask = torch.zeros(self.num_blocks, dtype=torch.int32, device=device)
        if invalid:
            mask[torch.tensor(sorted(invalid), dtype=torch.int64, device=device)] = 1
        return set(torch.nonzero(self.all_reduce(mask)).flatten().tolist())

    def finish(self, out: SchedulerOutput) -> KVConnectorOutput:
        """Save the step's blocks (the forward pass wrote them) and report what the connector finished."""
        connector = self.connector
        if out.kv_connector_metadata is not None:
            for i, kv_layer in enumerate(self.kv_caches):
                connector.save_kv_layer(i, kv_layer, None)
            connector.wait_for_save()
        sending, recving = connector.get_finished(set(out.finished_req_ids))
        connector.clear_connector_metadata()
        return KVConnectorOutput(finished_sending=sending or set(), finished_recving=recving or set(),
                                 invalid_block_ids=set(self.invalid))


def drop_samples(result: ModelRunnerOutput, req_ids: set[str]) -> None:
    """Take `req_ids`' sampled tokens (and logprobs) out of a step's result before they are appended."""
    keep = [i for i, r in enumerate(result.req_ids) if r not in req_ids]
    result.req_ids = [result.req_ids[i] for i in keep]
    result.sampled_token_ids = [result.sampled_token_ids[i] for i in keep]
    if result.logprobs is not None:
        result.logprobs = [result.logprobs[i] for i in keep]
