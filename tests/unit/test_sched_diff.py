"""WorkerView alone: what the worker knows, and the SchedulerOutput diff built from it."""
from __future__ import annotations

from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.diff import WorkerView, decodes_first


class _Tables:
    def __init__(self, **tables: list[int]):
        self.tables = tables

    def block_ids(self, request_id: str) -> list[int]:
        return self.tables[request_id]


def _req(rid: str, num_prompt: int = 6, computed: int = 0) -> Request:
    r = Request(rid, list(range(num_prompt)), SamplingParams(max_tokens=4), max_tokens=4)
    r.num_computed_tokens = computed
    return r


def test_a_request_crosses_once_then_only_its_new_blocks():
    view, a = WorkerView(), _req("a")
    tables = _Tables(a=[3, 4])
    out = view.build([(a, 6)], [], tables)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a"] and out.scheduled_new_reqs[0].block_ids == [3, 4]
    assert out.scheduled_cached_reqs.req_ids == [] and out.num_scheduled_tokens == {"a": 6}
    assert out.total_num_scheduled_tokens == 6 and view.num_blocks_sent == {"a": 2}
    a.num_computed_tokens = 6
    tables.tables["a"] = [3, 4, 9]
    out = view.build([(a, 1)], [], tables)
    cached = out.scheduled_cached_reqs
    assert out.scheduled_new_reqs == [] and cached.req_ids == ["a"] and cached.new_block_ids == [[9]]
    assert cached.resumed_from_preemption == [False] and cached.num_computed_tokens == [6]
    assert cached.num_kept_blocks == {}
    out = view.build([(a, 1)], [], tables)
    assert out.scheduled_cached_reqs.new_block_ids == [[]]


def test_a_shrunk_table_says_how_many_blocks_stay_once():
    view, a = WorkerView(), _req("a")
    tables = _Tables(a=[1, 2, 3])
    view.build([(a, 6)], [], tables)
    view.shrink("a", 2)
    assert view.num_blocks_sent == {"a": 2} and view.shrunk == {"a"}
    tables.tables["a"] = [1, 2, 7]
    cached = view.build([(a, 1)], [], tables).scheduled_cached_reqs
    assert cached.num_kept_blocks == {"a": 2} and cached.new_block_ids == [[7]]
    assert view.shrunk == set()
    assert view.build([(a, 1)], [], tables).scheduled_cached_reqs.num_kept_blocks == {}


def test_shrink_of_a_table_the_worker_never_had_is_ignored():
    view = WorkerView()
    view.shrink("x", 1)
    assert view.num_blocks_sent == {} and view.shrunk == set()


def test_a_preempted_request_comes_back_with_its_whole_new_table():
    view, a = WorkerView(), _req("a")
    view.build([(a, 6)], [], _Tables(a=[1, 2]))
    view.forget_table("a")
    out = view.build([], ["a"], _Tables())
    assert out.preempted_req_ids == {"a"} and out.is_empty
    a.num_preemptions = 1
    cached = view.build([(a, 6)], [], _Tables(a=[5, 6])).scheduled_cached_reqs
    assert cached.req_ids == ["a"] and cached.resumed_from_preemption == [True] and cached.new_block_ids == [[5, 6]]


def test_finished_ids_are_sent_once_and_only_if_the_worker_saw_them():
    view = WorkerView()
    view.build([(_req("a"), 6)], [], _Tables(a=[1]))
    view.finish("a", seen_by_worker=True)
    view.finish("never-ran", seen_by_worker=False)
    assert view.num_blocks_sent == {}
    assert view.build([], [], _Tables()).finished_req_ids == {"a"}
    assert view.build([], [], _Tables()).finished_req_ids == set()


def test_drafts_to_verify_are_copied_into_the_diff():
    view, a = WorkerView(), _req("a", computed=0)
    a.spec_token_ids = [8, 9]
    out = view.build([(a, 3)], [], _Tables(a=[1]))
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9]}
    a.spec_token_ids.clear()
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9]}


def test_decodes_first_is_stable_and_counts_verification_as_decodes():
    p1, d1, p2, v, d2 = (_req(r) for r in ("p1", "d1", "p2", "v", "d2"))
    v.spec_token_ids = [1, 2]
    entries = [(p1, 5), (d1, 1), (p2, 7), (v, 3), (d2, 1)]
    decodes_first(entries)
    assert [r.request_id for r, _ in entries] == ["d1", "v", "d2", "p1", "p2"]
