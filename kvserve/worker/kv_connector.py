"""The worker-side KV connector's calls around one step of the model runner (kv_transfer/base.py has the order).

Loads run after the step's diff is applied and before the forward pass; saves after it. A request one of whose
blocks failed to load gets no sampled token this step (its logits came from invalid KV): the scheduler then
recomputes from the first bad block or fails the request (kv_load_failure_policy).
"""
from __future__ import annotations

from kvserve.core_types import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from kvserve.worker.input_batch import InputBatch


def begin_kv_step(connector, out: SchedulerOutput, batch: InputBatch, kv_caches: list) -> set[str]:
    """Bind the step's metadata and load; returns the scheduled requests owning a block whose load failed."""
    meta = out.kv_connector_metadata
    if meta is None:
        return set()
    connector.bind_connector_metadata(meta)
    connector.start_load_kv()
    for i in range(len(kv_caches)):
        connector.wait_for_layer_load(i)
    invalid = connector.get_block_ids_with_load_errors()
    if not invalid:
        return set()
    failed = set()
    for req_id in out.num_scheduled_tokens:
        row = batch.index[req_id]
        if invalid.intersection(batch.block_table[row, :batch.num_blocks[row]].tolist()):
            failed.add(req_id)
    return failed


def finish_kv_step(connector, out: SchedulerOutput, kv_caches: list) -> KVConnectorOutput:
    """Save the step's blocks (the forward pass wrote them) and report what the connector finished."""
    invalid: set[int] = set()
    if out.kv_connector_metadata is not None:
        for i, kv_layer in enumerate(kv_caches):
            connector.save_kv_layer(i, kv_layer, None)
        connector.wait_for_save()
        invalid = connector.get_block_ids_with_load_errors()
    sending, recving = connector.get_finished(set(out.finished_req_ids))
    connector.clear_connector_metadata()
    return KVConnectorOutput(finished_sending=sending or set(), finished_recving=recving or set(),
                             invalid_block_ids=set(invalid))


def drop_samples(result: ModelRunnerOutput, req_ids: set[str]) -> None:
    """Take `req_ids`' sampled tokens (and logprobs) out of a step's result before they are appended."""
    keep = [i for i, r in enumerate(result.req_ids) if r not in req_ids]
    result.req_ids = [result.req_ids[i] for i in keep]
    result.sampled_token_ids = [result.sampled_token_ids[i] for i in keep]
    if result.logprobs is not None:
        result.logprobs = [result.logprobs[i] for i in keep]
