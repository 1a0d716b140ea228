"""AsyncEngine with its engine loop in a child process (what `kvserve serve` runs): streaming, a clean
shutdown, and the death of the engine process."""
from __future__ import annotations

import asyncio

import pytest

from kvserve.config import EngineArgs
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.sampling_params import SamplingParams


def test_engine_process_stream_shutdown_and_death(tiny_llama, caplog):
    """The child-process loop, read from the event loop's own thread: a stream's deltas add up; a clean
    shutdown is not reported as a death; a killed engine process fails the requests in flight and marks the
    engine dead."""
    async def main():
        args = EngineArgs(model=tiny_llama[0], kv_cache_memory="8MiB", num_threads=1, max_num_seqs=2)
        params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
        engine = AsyncEngine(args, use_process=True)
        await engine.start()
        ids = []
        async for out in await engine.add_request("a", [1, 2, 3], params):
            ids += out.new_token_ids[0]
        assert ids == out.outputs[0].token_ids and len(ids) == 6
        await engine.shutdown()
        assert engine.dead_reason == "the engine is shut down" and "engine loop stopped" not in caplog.text

        engine = AsyncEngine(args, use_process=True)
        await engine.start()
        try:
            stream = await engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))
            await stream.__anext__()
            engine._transport._process.kill()
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            assert "internal error" in engine.dead_reason and "engine process exited" in caplog.text
            with pytest.raises(EngineDeadError):
                await engine.add_request("late", [1, 2], params)
        finally:
            await engine.shutdown()

    asyncio.run(main())
