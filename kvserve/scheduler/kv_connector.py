"""The scheduler's side of a KV connector (kv_transfer/base.py): external prefix hits at admission, and what a
failed load does to the requests that owned the bad blocks (kv_load_failure_policy)."""
from __future__ import annotations

from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request


def external_hit(connector, req: Request, num_hit: int) -> int | None:
    """Tokens past the local hit `num_hit` that the connector loads; None: it does not know yet (the request
    waits). At least the last token is always computed (the step needs its logits)."""
    num, load_async = connector.get_num_new_matched_tokens(req, num_hit)
    if num is None:
        return None
    if load_async:
        raise NotImplementedError(f"{type(connector).__name__} loads asynchronously, which the scheduler does not "
                                  "support yet")
    return max(0, min(num, req.num_tokens - 1 - num_hit))


def first_invalid_block(kv: KVCacheManager, req: Request, invalid_block_ids: set[int]) -> int | None:
    """Index in req's table of its first block whose load failed; None: none of its blocks did."""
    return next((i for i, b in enumerate(kv.block_ids(req.request_id)) if b in invalid_block_ids), None)


def load_error_message(req: Request, num_bad: int) -> str:
    return (f"request {req.request_id}: loading its prompt's KV from the KV connector failed ({num_bad} block(s) "
            "missing or corrupt); kv_load_failure_policy is 'fail'")
