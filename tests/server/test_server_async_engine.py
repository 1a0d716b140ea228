"""AsyncEngine without HTTP: streaming deltas, admission control, abort, shutdown (engine loop on a thread)."""
from __future__ import annotations

import asyncio

import pytest

from kvserve.config import EngineArgs
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, RequestTimeoutError
from kvserve.sampling_params import SamplingParams


def _engine(path: str, **kwargs) -> AsyncEngine:
    args = EngineArgs(model=path, kv_cache_memory="8MiB", num_threads=1, max_num_seqs=2)
    return AsyncEngine(args, use_process=False, **kwargs)


def test_stream_deltas_admission_abort_and_shutdown(tiny_llama):
    async def main():
        engine = _engine(tiny_llama[0], max_queue_len=1)  # capacity: 2 running + 1 waiting
        reports = []
        engine.add_listener(reports.append)
        info = await engine.start()
        assert info.max_model_len == 1024 and engine.tokenizer is not None

        # deltas add up to the final output, even when a slow consumer gets several merged
        params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
        stream = await engine.add_request("a", [1, 2, 3], params)
        ids, text = [], ""
        async for out in stream:
            ids += out.new_token_ids[0]
            text += out.new_texts[0]
            await asyncio.sleep(0.01)
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert ids == out.outputs[0].token_ids and len(ids) == 12 and text == out.outputs[0].text
        assert engine.num_inflight_seqs == 0

        # the engine's own validation comes back as ValueError, and frees the admission slot
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("long", list(range(1, 1100)), params)
        assert engine.num_inflight_seqs == 0

        # past max_num_seqs + max_queue_len sequences: overloaded, never queued
        long = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
        streams = [await engine.add_request(f"s{i}", [5, 6, 7], long) for i in range(3)]
        with pytest.raises(EngineOverloadedError):
            await engine.add_request("one-too-many", [5, 6, 7], long)

        # closing an unfinished stream aborts it; its blocks are free after the next step
        for s in streams:
            await s.__anext__()
            s.close()
        while engine.num_inflight_seqs:
            await asyncio.sleep(0.01)
        assert engine.stats.kv_cache_usage == 0 and engine.stats.num_running == 0
        assert reports and reports[-1].stats is engine.stats

        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", [1, 2], params)

    asyncio.run(main())


def test_deadline_aborts_a_stream_and_a_finished_stream_cancels_its_timer(tiny_llama):
    """One timer per stream: past its deadline the request is aborted and the iterator raises
    RequestTimeoutError (blocks freed); a stream that finishes first cancels its timer."""
    async def main():
        engine = _engine(tiny_llama[0])
        await engine.start()
        loop = asyncio.get_running_loop()
        long = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0)
        stream = await engine.add_request("slow", [1, 2, 3], long, deadline=loop.time() + 0.3)
        outputs = 0
        with pytest.raises(RequestTimeoutError, match="--request-timeout"):
            async for _ in stream:
                outputs += 1
        assert 0 < outputs < 1000 and stream.finished
        while engine.num_inflight_seqs:
            await asyncio.sleep(0.01)
        assert engine.stats.kv_cache_usage == 0

        done = await engine.add_request("quick", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True),
                                        deadline=loop.time() + 60)
        async for out in done:
            pass
        assert out.finished and done._timer.cancelled()
        await engine.shutdown()

    asyncio.run(main())


def test_bad_engine_args_fail_start(tmp_path):
    async def main():
        engine = AsyncEngine(EngineArgs(model=str(tmp_path / "missing")), use_process=False)
        with pytest.raises(RuntimeError, match="model not found"):
            await engine.start()

    asyncio.run(main())
