"""WorkerView: what the worker already knows, so that each SchedulerOutput carries only the diff.

The scheduler tells it when a request's table is forgotten (preempted, finished), shrinks (rejected drafts
gave blocks back) or a request finishes; `build` turns one step's decisions into the SchedulerOutput.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvserve.request import Request
from kvserve.core_types import CachedRequestData, NewRequestData, SchedulerOutput


class BlockTables(Protocol):
    def block_ids(self, request_id: str) -> list[int]: ...


@dataclass
class WorkerView:
    num_blocks_sent: dict[str, int] = field(default_factory=dict)
    """Running request -> leading blocks of its table the worker has."""
    finished_ids: set[str] = field(default_factory=set)
    """Requests the worker has seen that finished since the last build."""
    shrunk: set[str] = field(default_factory=set)
    """Tables that gave blocks back since the worker last heard of them."""

    def forget_table(self, req_id: str) -> None:
        """The request's blocks were released (preempted or finished): the worker's copy is void."""
        self.num_blocks_sent.pop(req_id, None)
        self.shrunk.discard(req_id)

    def finish(self, req_id: str, seen_by_worker: bool) -> None:
        self.forget_table(req_id)
        if seen_by_worker:
            self.finished_ids.add(req_id)

    def shrink(self, req_id: str, num_blocks_held: int) -> None:
        """The request's table now has num_blocks_held blocks (free_tail gave some back)."""
        sent = self.num_blocks_sent.get(req_id)
        if sent is not None:
            self.num_blocks_sent[req_id] = min(sent, num_blocks_held)
            self.shrunk.add(req_id)

    def build(self, scheduled: list[tuple[Request, int]], preempted: list[str],
              tables: BlockTables) -> SchedulerOutput:
        """The SchedulerOutput of a step that computes `scheduled` (request, tokens), in that order; the view
        then counts every scheduled table as sent and the finished ids as told."""
        new, cached = [], CachedRequestData()
        for req, _ in scheduled:
            block_ids = tables.block_ids(req.request_id)
            sent = self.num_blocks_sent.get(req.request_id)
            self.num_blocks_sent[req.request_id] = len(block_ids)
            if sent is not None:  # running since an earlier step: only the new blocks
                self._add_cached(cached, req, block_ids[sent:], resumed=False)
                if req.request_id in self.shrunk:
                    cached.num_kept_blocks[req.request_id] = sent
                    self.shrunk.discard(req.request_id)
            elif req.num_preemptions:  # back after a preemption: the worker kept its tokens, not its blocks
                self._add_cached(cached, req, block_ids, resumed=True)
            else:
                new.append(NewRequestData(
                    req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                    sampling_params=req.sampling_params, eos_token_ids=req.eos_token_ids, block_ids=block_ids,
                    num_computed_tokens=req.num_computed_tokens, lora_request=req.lora_request))
        finished, self.finished_ids = self.finished_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached,
            num_scheduled_tokens={req.request_id: n for req, n in scheduled},
            total_num_scheduled_tokens=sum(n for _, n in scheduled),
            scheduled_spec_decode_tokens={req.request_id: list(req.spec_token_ids)
                                          for req, _ in scheduled if req.spec_token_ids},
            finished_req_ids=finished, preempted_req_ids=set(preempted))

    @staticmethod
    def _add_cached(cached: CachedRequestData, req: Request, new_block_ids: list[int], resumed: bool) -> None:
        cached.req_ids.append(req.request_id)
        cached.resumed_from_preemption.append(resumed)
        cached.new_block_ids.append(new_block_ids)
        cached.num_computed_tokens.append(req.num_computed_tokens)


def decodes_first(scheduled: list[tuple[Request, int]]) -> None:
    """Sort a step's (request, tokens) entries in place, stably, so that decodes come first: the order of the
    batch (the attention backends' contract). A request verifying drafts is a run of decodes."""
    scheduled.sort(key=lambda entry: entry[1] != 1 and not entry[0].spec_token_ids)
